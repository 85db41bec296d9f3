#!/usr/bin/env bash
# The server's packages that the device image lacks, as wheels in .whl/ (git-ignored), at the versions .venv holds
# (pyproject.toml's pins): carry .whl with a device call (the run tool's carry [".whl"]) and `h200_checks.sh startup`
# / `serve` install them there where the image lacks them. FastAPI's and uvicorn's stacks, opentelemetry-api
# (which fastapi imports) and aiohttp's (the benchmark client's): each with what it requires.
set -euo pipefail
cd "$(dirname "$0")/.."
pkgs="annotated-doc annotated-types anyio click fastapi h11 httptools idna opentelemetry-api pydantic pydantic-core
      sniffio starlette typing-extensions typing-inspection uvicorn
      aiohappyeyeballs aiohttp aiosignal attrs frozenlist multidict propcache yarl"
pins=$(.venv/bin/python -m pip freeze | python3 -c '
import re, sys
want = {re.sub("[-_.]+", "-", p) for p in sys.argv[1].split()}
for line in sys.stdin:
    name = re.sub("[-_.]+", "-", line.split("==")[0].lower())
    if "==" in line and name in want:
        print(line.strip())' "$pkgs")
[ "$(echo "$pins" | wc -l)" -eq "$(echo $pkgs | wc -w)" ] || { echo "not all of [$pkgs] are in .venv" >&2; exit 1; }
rm -rf .whl
.venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --platform manylinux2014_x86_64 -d .whl $pins
ls .whl
