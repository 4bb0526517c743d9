#!/bin/bash
# The second pass's tests, run on 789087e (the code the second review read) with their test files copied in.
set -u
rm -rf /tmp/old60u && git clone -q /work/main /tmp/old60u && cd /tmp/old60u && git checkout -q 789087e
ln -s /work/main/.venv .venv; ln -s /work/main/.kvpool .kvpool
for f in tests/unit/test_direct_controls.py tests/daemon/test_batched_daemon.py tests/unit/test_reliability.py; do
  git -C /work/main show 7e05443:$f > $f
done
echo "\$ cd /tmp/old60u (789087e, the second pass's test files copied in) && .venv/bin/python -m pytest -p no:cacheprovider -q --tb=line -rf <its tests>"
.venv/bin/python -m pytest -p no:cacheprovider -q --tb=line -rf \
  "tests/unit/test_direct_controls.py::test_a_direct_append_seen_busy_as_it_ends_is_taken_once_its_time_is_written" \
  "tests/daemon/test_batched_daemon.py::test_an_unexpected_error_in_the_batcher_answers_every_append_it_holds" \
  "tests/unit/test_reliability.py::test_a_request_over_the_daemons_frame_limit_is_refused_before_it_is_sent" 2>&1 | grep -E "^/|^E |^FAILED|passed|failed"
