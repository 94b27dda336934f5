"""Print ``export`` lines that give uv the package sources pip is configured
with, so that ``uv pip install`` resolves as ``pip install`` does here.

Reads ``pip config list`` on standard input (``section.key='value'``, one a
line; ``:env:`` entries are PIP_* variables, which win over the files, as in
pip). Carried over: ``index-url``, ``extra-index-url``, ``find-links``,
``constraint`` and ``cert``; uv is told to take the best version across all
sources, as pip does (its own default stops at the first index that has a
package).
"""

import shlex
import sys

# pip's key -> (uv's variable, the separator uv expects between values)
KEYS = {"index-url": ("UV_INDEX_URL", " "),
        "extra-index-url": ("UV_EXTRA_INDEX_URL", " "),
        "find-links": ("UV_FIND_LINKS", ","),
        "constraint": ("UV_CONSTRAINT", " "),
        "cert": ("SSL_CERT_FILE", " ")}


def settings(lines) -> dict[str, str]:
  """uv's environment variables for ``pip config list``'s ``lines``."""
  found = {}
  for line in lines:
    key, sep, value = line.strip().partition("=")
    section, _, name = key.rpartition(".")
    if not sep or name not in KEYS:
      continue
    if name in found and section != ":env:":
      continue  # a PIP_* variable wins over the files
    found[name] = value.strip("'\"").split()
  env = {KEYS[name][0]: KEYS[name][1].join(values)
         for name, values in found.items() if values}
  env["UV_INDEX_STRATEGY"] = "unsafe-best-match"
  return env


if __name__ == "__main__":
  for name, value in sorted(settings(sys.stdin).items()):
    print(f"export {name}={shlex.quote(value)}")
