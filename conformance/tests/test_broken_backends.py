"""The suite can fail: run every suite on the example backend and on
deliberately broken doubles of it (broken_backends.py; some doubles run only
the suites named in its SUITES), in one pytest subprocess, and check that
each double fails the tests meant to catch its breakage while the suites
that do not depend on that contract still pass."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
#: the first test waits for one run of the suites on every double (about three minutes on two busy cores,
#: over ten on a slow VM: 600 s timed out there once), bounded at 1200 s by the run's own timeout
pytestmark = pytest.mark.timeout(1500)

RUNNER = '''
import pytest
import kvt_conformance as kc
import broken_backends as bb


def _wait_for(self):
    return 3.0  # the doubles never deliver what some tests wait for: do not wait long


for _v in bb.VARIANTS:
    for _suite in kc.ALL_SUITES:
        if _suite.__name__ not in bb.SUITES.get(_v.__name__, (_suite.__name__,)):
            continue
        _name = f"Test{_v.__name__}_{_suite.__name__}"
        _body = {"backend_target": _v}
        if _v.__name__ not in bb.OWN_TIMEOUTS:
            _body.update(backend_options={"timeout": 2.0}, wait_for=pytest.fixture(_wait_for))
        globals()[_name] = type(_name, (_suite,), _body)
'''

OUTSIDE_REGIONS = [f"ErrorTests::test_local_descriptors_outside_registered_memory[{c}]"
                   for c in ("unregistered", "past-the-end", "before-the-start", "deregistered")] + \
                  [f"ErrorTests::test_peer_descriptors_outside_registered_memory[{c}]"
                   for c in ("unregistered", "past-the-end", "one-bad-row-of-many")]
NOTIFICATION_TESTS = [f"NotificationTests::{t}" for t in (
    "test_standalone", "test_in_order_per_peer", "test_from_peer_in_order", "test_two_senders_each_in_order",
    "test_largest_declared_message", "test_attached_to_write_arrives_after_its_data", "test_attached_to_read",
    "test_attached_to_local_transfer")]

#: tests a variant that replaces ExampleBackend._run may fail without that being its breakage: its
#: copies are not counted for deregister (or close) to wait on, nor checked against our own registrations
#: (test_the_unbroken_example_passes holds the example to them)
RUN_REPLACED = {*(f"OwnerCheckTests::test_{verb}_waits_for_requests_in_flight[{op}]"
                  for verb in ("deregister", "close") for op in ("READ", "WRITE")),
                *(f"CompletionTests::test_deregister_stops_our_transfers_of_that_memory[local-{op}]"
                  for op in ("READ", "WRITE"))}

#: variant -> (tests that must fail, areas and tests that must still pass)
EXPECT = {
    "BrokenEarlyDone": (
        ["CompletionTests::test_never_done_before_the_data[local-READ-DRAM]",
         "CompletionTests::test_never_done_before_the_data[local-WRITE-DRAM]",
         "TransferTests::test_single_block[local-READ-DRAM]", "TransferTests::test_single_block[local-WRITE-DRAM]",
         "EngineScenarioTests::test_scheduler_drives_prefill_and_decode"],
        ["registration", *OUTSIDE_REGIONS, "NotificationTests::test_standalone",
         "NotificationTests::test_in_order_per_peer", "MetadataTests::test_reload_refreshes_registrations"]),
    "BrokenEarlyDoneRead": (
        ["CompletionTests::test_done_means_every_byte_landed_at_the_peer[READ]",
         "CompletionTests::test_never_done_before_the_data[local-READ-DRAM]"],
        ["registration", "NotificationTests::test_standalone",
         "CompletionTests::test_done_means_every_byte_landed_at_the_peer[WRITE]"]),
    "BrokenEarlyDoneWrite": (
        ["CompletionTests::test_done_means_every_byte_landed_at_the_peer[WRITE]",
         "CompletionTests::test_never_done_before_the_data[local-WRITE-DRAM]"],
        # metadata but the re-add test, which reads the peer's bytes at DONE and so catches this double too
        ["registration", "notifications", "errors", "MetadataTests::test_reload_refreshes_registrations",
         "MetadataTests::test_remove_remote", "MetadataTests::test_hostile_metadata_fields",
         "MetadataTests::test_readding_unchanged_metadata_leaves_transfers_in_flight_alone[READ]",
         "CompletionTests::test_done_means_every_byte_landed_at_the_peer[READ]"]),
    "BrokenNoOwnerCheck": (
        [f"OwnerCheckTests::test_stale_metadata_is_refused[{op}]" for op in ("READ", "WRITE")],
        ["registration", "descriptors", "transfers", "completion", "notifications", "metadata", "errors",
         "faults", "concurrency", "cross-host", "engine"]),
    "BrokenEarlyNotif": (
        [f"NotificationTests::test_attached_notif_follows_every_byte_{where}[{op}]"
         for where in ("at_the_peer", "locally") for op in ("READ", "WRITE")],
        ["registration", "descriptors", "transfers", "completion", "owner checks", "metadata", "errors",
         "faults", "concurrency", "cross-host"]),
    "BrokenCrossHost": (
        ["CrossHostTests::test_cross_host_implies_remote",
         *(f"CrossHostTests::test_transfers_with_same_host_shortcuts_off[{op}]" for op in ("READ", "WRITE"))],
        ["registration", "descriptors", "transfers", "completion", "notifications", "owner checks", "metadata",
         "errors", "faults", "concurrency", "engine"]),
    "BrokenNoBoundsCheck": (
        [*OUTSIDE_REGIONS, "RegistrationTests::test_registered_memory_is_the_only_preppable_memory[DRAM]",
         "RegistrationTests::test_overlapping_regions", "MetadataTests::test_reload_refreshes_registrations",
         "OwnerCheckTests::test_stale_metadata_is_refused[READ]"],
        ["transfers", "completion", "notifications", "concurrency", "engine", "faults", "descriptors"]),
    "BrokenDropsNotifs": (
        [*NOTIFICATION_TESTS, "ConcurrencyTests::test_notify_from_several_threads",
         "EngineScenarioTests::test_scheduler_drives_prefill_and_decode",
         # the marker that follows each refused notify never arrives either
         *(f"ErrorTests::test_bad_notify_raises_its_kvt_error[{c}]" for c in ("too-large", "text", "none", "int"))],
        ["registration", "descriptors", "transfers", "completion", "metadata", "errors", "faults",
         "ConcurrencyTests::test_many_in_flight[local-READ]", "NotificationTests::test_nothing_pending_is_empty"]),
    "BrokenDeregisterNoDrain": (
        [*(f"OwnerCheckTests::test_deregister_waits_for_requests_in_flight[{op}]" for op in ("READ", "WRITE")),
         *(f"CompletionTests::test_deregister_stops_our_transfers_of_that_memory[local-{op}]" for op in ("READ", "WRITE"))],
        ["registration", "CompletionTests::test_release_in_flight[local-READ]",
         "CompletionTests::test_released_transfer_lands_nothing_later[local-READ]",
         *(f"OwnerCheckTests::test_stale_metadata_is_refused[{op}]" for op in ("READ", "WRITE"))]),
    "BrokenOwnMemoryUnchecked": (
        [f"CompletionTests::test_deregister_stops_our_transfers_of_that_memory[local-{op}]" for op in ("READ", "WRITE")],
        ["registration", "CompletionTests::test_release_in_flight[local-READ]",
         "CompletionTests::test_never_done_before_the_data[local-READ-DRAM]"]),
    "BrokenReleaseReturnsEarly": (
        [f"CompletionTests::test_released_transfer_lands_nothing_later[local-{op}]" for op in ("READ", "WRITE")],
        ["transfers", "engine",
         "CompletionTests::test_release_in_flight[local-READ]", "CompletionTests::test_release_in_flight[local-WRITE]"]),
    "BrokenNotifAfterFirstRequest": (
        [f"NotificationTests::test_attached_notif_follows_every_byte_of_a_long_list[{op}]" for op in ("READ", "WRITE")],
        ["descriptors", "transfers",
         *(f"NotificationTests::test_attached_notif_follows_every_byte_at_the_peer[{op}]" for op in ("READ", "WRITE"))]),
    "BrokenRangeArithmetic": (
        [f"ErrorTests::test_{side}_descriptors_outside_registered_memory[{c}]"
         for side in ("local", "peer") for c in ("one-byte-past-the-end", "length-wraps")],
        ["registration", "transfers", *OUTSIDE_REGIONS]),
    "BrokenOwnerChecksStartsOnly": (
        [f"OwnerCheckTests::test_stale_metadata_past_a_shrunk_registration_is_refused[{op}]" for op in ("READ", "WRITE")],
        ["transfers", *(f"OwnerCheckTests::test_stale_metadata_is_refused[{op}]" for op in ("READ", "WRITE"))]),
    "BrokenPeerOnlyNoPairCheck": (
        [f"ErrorTests::test_bad_transfer_with_a_peer_raises_its_kvt_error[{c}]"
         for c in ("count-mismatch", "length-mismatch")],
        ["transfers", "completion", "ErrorTests::test_undeclared_local_transfer"]),
    "BrokenMetadataLeaksValueError": (
        ["MetadataTests::test_hostile_metadata_fields"],
        ["transfers",
         *(f"MetadataTests::test_malformed_metadata[{how}]" for how in ("truncated", "random", "another-message"))]),
    "BrokenNotifOnRefusal": (
        [f"OwnerCheckTests::test_refused_transfer_sends_no_notification[{op}]" for op in ("READ", "WRITE")],
        ["notifications", *(f"OwnerCheckTests::test_stale_metadata_is_refused[{op}]" for op in ("READ", "WRITE"))]),
    "BrokenEmptyPeerName": (
        ["MetadataTests::test_bad_peer_name_is_refused[empty]"],
        ["transfers", "MetadataTests::test_hostile_metadata_fields", "MetadataTests::test_remove_remote",
         *(f"MetadataTests::test_malformed_metadata[{how}]" for how in ("truncated", "random", "another-message"))]),
    "BrokenLongPeerName": (
        ["MetadataTests::test_bad_peer_name_is_refused[257-chars]"],
        ["MetadataTests::test_bad_peer_name_is_refused[empty]", "MetadataTests::test_remove_remote"]),
    "BrokenReaddDropsPeer": (
        [f"MetadataTests::test_readding_unchanged_metadata_leaves_transfers_in_flight_alone[{op}]"
         for op in ("READ", "WRITE")],
        ["transfers", "MetadataTests::test_reload_refreshes_registrations", "MetadataTests::test_remove_remote",
         "MetadataTests::test_round_trip_through_handshake"]),
    "BrokenAcceptsAnyOption": (
        ["ErrorTests::test_unknown_option_is_refused"],
        ["ErrorTests::test_calls_after_close", *(f"ErrorTests::test_unknown_peer[{n}]" for n in ("str", "list", "dict"))]),
    "BrokenUnhashablePeerName": (
        [f"ErrorTests::test_unknown_peer[{n}]" for n in ("list", "dict")],
        ["ErrorTests::test_unknown_peer[str]", "ErrorTests::test_calls_after_close"]),
    "BrokenCloseNoDrain": (
        [f"OwnerCheckTests::test_close_waits_for_requests_in_flight[{op}]" for op in ("READ", "WRITE")],
        ["registration", *(f"OwnerCheckTests::test_deregister_waits_for_requests_in_flight[{op}]"
                           for op in ("READ", "WRITE"))]),
    "BrokenTruncatesLongRows": (
        [f"TransferTests::test_row_longer_than_any_chunk[local-{op}]" for op in ("READ", "WRITE")],
        [f"TransferTests::test_{t}[local-{op}]" for t in ("multi_megabyte_block", "whole_lists") for op in ("READ", "WRITE")]),
    "BrokenTransferAfterRemove": (
        [f"MetadataTests::test_a_prep_from_before_remove_remote_moves_nothing[{op}]" for op in ("READ", "WRITE")],
        ["MetadataTests::test_remove_remote", "MetadataTests::test_reload_refreshes_registrations",
         "MetadataTests::test_round_trip_through_handshake"]),
    "BrokenRemoveKeepsInFlight": (
        ["FaultTests::test_remove_remote_ends_in_flight_transfers"],
        ["metadata", "FaultTests::test_handshake_with_nobody_there"]),
    "BrokenDupAttachedNotif": (
        [f"NotificationTests::test_attached_notif_{t}[{op}]" for op in ("READ", "WRITE")
         for t in ("arrives_exactly_once_at_its_target", "reaches_its_target_among_two_peers")],
        ["NotificationTests::test_standalone", "NotificationTests::test_in_order_per_peer",
         "NotificationTests::test_attached_to_read", "NotificationTests::test_attached_to_local_transfer"]),
    "BrokenNotifToLastPeer": (
        [f"NotificationTests::test_attached_notif_reaches_its_target_among_two_peers[{op}]" for op in ("READ", "WRITE")],
        ["NotificationTests::test_standalone", "NotificationTests::test_attached_to_read",
         *(f"NotificationTests::test_attached_notif_arrives_exactly_once_at_its_target[{op}]" for op in ("READ", "WRITE"))]),
    "BrokenNotifyNoSizeCheck": (
        ["ErrorTests::test_bad_notify_raises_its_kvt_error[too-large]"],
        ["notifications", *(f"ErrorTests::test_bad_notify_raises_its_kvt_error[{c}]" for c in ("text", "none", "int"))]),
    "BrokenNotifyNoTypeCheck": (
        [f"ErrorTests::test_bad_notify_raises_its_kvt_error[{c}]" for c in ("text", "none", "int")],
        ["notifications", "ErrorTests::test_bad_notify_raises_its_kvt_error[too-large]"]),
    "BrokenReleasePrepEndsTransfers": (
        [f"CompletionTests::test_releasing_preps_leaves_their_transfers_alone[local-{op}]" for op in ("READ", "WRITE")],
        ["descriptors", *(f"CompletionTests::test_{t}[local-{op}]" for t in ("release_in_flight", "done_stays_done")
                          for op in ("READ", "WRITE"))]),
    "BrokenSettledEarly": (
        [f"CompletionTests::test_never_done_before_the_data[local-{op}-DRAM]" for op in ("READ", "WRITE")]
        + ["CompletionTests::test_handles_are_distinct"],
        ["registration"]),
    "BrokenLeaksWorkerOnClose": (
        ["ConcurrencyTests::test_closed_backends_leave_no_thread_or_fd_behind"],
        ["errors", "ConcurrencyTests::test_many_in_flight[local-READ]"]),
    # a double of the host backend (its peers are processes, which a frozen-peer test needs); left out
    # where the host plugin is not installed
    "BrokenHostBlockingCheckState": (
        ["FaultTests::test_check_state_returns_while_peer_frozen"],
        ["FaultTests::test_transfer_posts_while_peer_frozen", "FaultTests::test_handshake_with_nobody_there",
         "FaultTests::test_remove_remote_ends_in_flight_transfers"]),
    "BrokenHostFailsOnePerTimeout": (
        ["FaultTests::test_frozen_peer_fails_every_queued_transfer_within_one_timeout"],
        ["FaultTests::test_transfer_posts_while_peer_frozen", "FaultTests::test_check_state_returns_while_peer_frozen",
         "FaultTests::test_remove_remote_ends_in_flight_transfers"]),
    # the example's copies run in Python, slow enough for any deregister to land in the middle of one: is
    # a backend whose copies take a few ms caught too?
    "BrokenHostDeregisterNoDrain": (
        [f"OwnerCheckTests::test_deregister_waits_for_requests_in_flight[{op}]" for op in ("READ", "WRITE")],
        ["registration", "OwnerCheckTests::test_close_waits_for_requests_in_flight[READ]",
         "OwnerCheckTests::test_close_waits_for_requests_in_flight[WRITE]"]),
}


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> dict[str, dict[str, tuple[str, str]]]:
    """variant -> {"Suite::test[params]": (area, outcome)} from one run of every suite on every variant."""
    work = tmp_path_factory.mktemp("broken")
    (work / "test_variants.py").write_text(RUNNER)
    report = work / "report.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "pytest", "test_variants.py", "-q", "-p", "no:cacheprovider",
                           f"--kvt-report={report}", "--timeout=120"],
                          cwd=work, env=env, capture_output=True, text=True, timeout=1200)
    assert report.exists(), f"the run wrote no report:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    out: dict[str, dict[str, tuple[str, str]]] = {}
    for t in json.loads(report.read_text())["tests"]:
        cls, test = t["nodeid"].split("::", 2)[1:]
        variant, suite = cls.removeprefix("Test").split("_", 1)
        out.setdefault(variant, {})[f"{suite}::{test}"] = (t["area"], t["outcome"])
    return out


def _failed(results: dict[str, tuple[str, str]]) -> set[str]:
    return {k for k, (_, outcome) in results.items() if outcome in ("failed", "error")}


def test_the_unbroken_example_passes(outcomes):
    assert not _failed(outcomes["ExampleBackend"]), sorted(_failed(outcomes["ExampleBackend"]))


@pytest.mark.parametrize("variant", list(EXPECT))
def test_each_broken_variant_fails_the_tests_meant_to_catch_it(outcomes, variant):
    must_fail, must_pass = EXPECT[variant]
    if variant not in outcomes:
        pytest.skip(f"{variant} did not run (a double of a plugin that is not installed)")
    results, control = outcomes[variant], _failed(outcomes["ExampleBackend"])
    # caught: failed on this variant (whether the control passes is test_the_unbroken_example_passes's concern)
    missed = [t for t in must_fail if t not in _failed(results)]
    assert not missed, f"{variant} was not caught by {missed}"
    failed = _failed(results) - control - RUN_REPLACED  # failures the control has are not this variant's doing
    should_pass = {k for k, (area, _) in results.items() if (area in must_pass or k in must_pass) and k not in must_fail}
    assert should_pass, f"nothing selected by {must_pass}"
    wrongly = sorted(failed & should_pass)
    assert not wrongly, f"{variant} broke tests unrelated to its breakage: {wrongly}"
