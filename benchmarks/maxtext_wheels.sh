# Fetch, into .whl/ (ignored by git), the wheels that MaxText 0.2.5's model
# and trainer need on a GPU machine without a package index whose image has
# jax 0.11 and Python 3.12 (benchmarks/gpu_setup.sh installs them there,
# --no-deps, into a --target folder on PYTHONPATH), and a stub of xprof,
# which tokamax imports only for its benchmarking helpers. Run from the
# repo root on a machine with a package index:
#   bash benchmarks/maxtext_wheels.sh
set -euo pipefail
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 \
  --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl \
  maxtext==0.2.5 flax==0.12.12 tokamax==0.0.17 qwix==0.1.8 aqtp==0.9.0 \
  grain==0.2.18 array_record==0.8.6 sentencepiece==0.2.3 tiktoken==0.14.0 \
  drjax==0.2.1 pathwaysutils==0.1.13 omegaconf==2.4.0 einshape==1.0 \
  immutabledict==4.3.1 jaxtyping==0.3.11 wadler_lindig==0.1.8 \
  tensorboardX==2.6.5 gviz-api==1.10.0 treescope==0.1.10 fastapi==0.165.0 \
  starlette==1.10.0 uvicorn==0.54.0 annotated-doc==0.0.7 anyio==4.16.0 \
  h11==0.16.0 typing-inspection==0.4.5 pydantic==2.14.4 \
  pydantic_core==2.50.5 annotated-types==0.8.0 cloudpickle==3.1.3 \
  more-itertools==11.2.1 humanize==4.17.0 simplejson==4.3.0 \
  portpicker==1.6.0 toolz==1.2.0 opt_einsum==3.4.0 rich==15.0.0 \
  markdown-it-py==4.3.0 mdurl==0.1.2 Pygments==2.21.0 termcolor==3.3.0 \
  fire==0.7.1 typer==0.29.2 shellingham==1.5.4 click==8.5.1 \
  opentelemetry-api==1.45.2 prometheus_client==0.26.0 sympy==1.14.0 \
  mpmath==1.3.0 truststore==0.10.5 msgpack==1.2.4 uvloop==0.23.0 \
  regex==2026.11.19 zipp==4.1.2 ml_collections==1.1.0
# xprof's stub: the one name tokamax's import reads.
mkdir -p .whl/xprof-stub/xprof/cli
touch .whl/xprof-stub/xprof/__init__.py .whl/xprof-stub/xprof/cli/__init__.py
echo "get_kernel_stats_tool = None" > .whl/xprof-stub/xprof/cli/tools.py
