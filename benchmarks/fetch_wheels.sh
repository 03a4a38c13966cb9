#!/usr/bin/env bash
# Downloads the pure-Python and cp312 manylinux wheels that the GPU machine
# lacks (it has no network) into .whl/, which every device run carries;
# auditwheel and pyelftools give packaging/build_wheel.sh the manylinux tag there.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d .whl \
  "sqlalchemy==2.1.9" "alembic==1.20.1" "mako==1.3.10" "pydantic==2.14.4" \
  "pydantic-core==2.50.5" "annotated-types==0.7.0" "typing-inspection==0.4.4" \
  "typing-extensions==4.16.0" "platformdirs==4.14.9" "auditwheel==6.8.2" "pyelftools==0.33"
ls .whl
