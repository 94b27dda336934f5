"""MaxText's own trainer with jax_ring's attention installed::

  python -m jax_ring.maxtext.train [--strategy S] [--implementation I] \\
      path/to/base.yml key=value ...

Everything after the options is MaxText's command line, as for
``python -m maxtext.trainers.pre_train.train``; ``--strategy`` and
``--implementation`` are :func:`jax_ring.maxtext.install`'s arguments.
"""

from __future__ import annotations

import argparse
import sys

from jax_ring.maxtext._patch import install


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
  """(install's options, MaxText's argv): the options are read only
  before the first positional argument (MaxText's config file)."""
  parser = argparse.ArgumentParser(
      prog="python -m jax_ring.maxtext.train",
      description="MaxText's trainer with jax_ring's attention.")
  parser.add_argument("--strategy", default="auto",
                      choices=("auto", "ring", "all_gather", "ulysses"))
  parser.add_argument("--implementation", default=None,
                      choices=("xla", "cudnn"))
  parser.add_argument("config", help="MaxText's config file (base.yml)")
  parser.add_argument("overrides", nargs=argparse.REMAINDER,
                      help="MaxText's key=value overrides")
  args = parser.parse_args(argv)
  return args, [args.config, *args.overrides]


def main(argv: list[str] | None = None):
  args, maxtext_argv = parse(sys.argv[1:] if argv is None else argv)
  install(args.strategy, args.implementation)
  from absl import app
  from maxtext.trainers.pre_train import train
  app.run(train.main, argv=[sys.argv[0], *maxtext_argv])


if __name__ == "__main__":
  main()
