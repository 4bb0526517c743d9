#!/bin/bash
# The tests this stop added, run on the code before it (98c162e) with the new test files copied in.
set -u
rm -rf /tmp/old60t && git clone -q /work/main /tmp/old60t && cd /tmp/old60t && git checkout -q 98c162e
ln -s /work/main/.venv .venv; ln -s /work/main/.kvpool .kvpool
for f in tests/daemon/test_batched_daemon.py tests/runtime/test_pipe_round_trips.py tests/daemon/test_direct_channel.py tests/unit/test_prefix_contract.py tests/support/service.py tests/unit/test_direct_controls.py tests/unit/test_batched_step_outputs.py tests/runtime/test_batched_runtime.py tests/unit/test_reliability.py; do
  git -C /work/main show 789087e:$f > $f
done
echo "\$ cd /tmp/old60t (98c162e, this stop's test files copied in) && .venv/bin/python -m pytest -p no:cacheprovider -q -rf <the new tests>"
.venv/bin/python -m pytest -p no:cacheprovider -q --tb=line -rf \
  "tests/daemon/test_batched_daemon.py::test_a_session_cancelled_in_a_shared_batch_is_rolled_back_before_it_is_answered" \
  "tests/daemon/test_batched_daemon.py::test_a_rollback_never_lands_on_the_session_lent_that_sequence_next" \
  "tests/daemon/test_batched_daemon.py::test_an_unexpected_error_in_the_batcher_answers_every_append_it_holds" \
  "tests/runtime/test_pipe_round_trips.py::test_a_binding_made_by_a_run_a_newer_epoch_fenced_meanwhile_is_revoked_before_the_lock_goes" \
  "tests/daemon/test_direct_channel.py::test_an_eviction_revokes_the_channel_even_when_the_admitting_append_is_then_refused" \
  "tests/daemon/test_direct_channel.py::test_a_request_frame_over_the_channels_limit_drops_its_peer_at_the_edge" \
  "tests/daemon/test_direct_channel.py::test_the_direct_channel_takes_no_request_larger_than_the_daemons_socket_does" \
  "tests/unit/test_prefix_contract.py::test_a_router_follows_a_daemon_replaced_on_its_socket_by_one_of_another_block" \
  tests/unit/test_direct_controls.py tests/unit/test_batched_step_outputs.py \
  "tests/runtime/test_batched_runtime.py::test_outputs_given_are_written_in_place_and_exact_and_bad_ones_touch_nothing" 2>&1 | grep -E "^/|^E |^FAILED|passed|failed"
