"""The node agent's log endpoint rules: query parsing, tail selection, byte limits, follow steps, Node fields."""
import pytest

from rlfleet.devcluster.node_agent import container_logs as cl
from rlfleet.devcluster.node_agent import plan


def reader(data: bytes, reads: list[tuple[int, int]] | None = None):
    def read_at(offset: int, length: int) -> bytes:
        if reads is not None:
            reads.append((offset, length))
        return data[offset:offset + length]
    return read_at


def tail(data: bytes, lines: int, block: int = cl.READ_BLOCK) -> bytes:
    return data[cl.tail_start(len(data), reader(data), lines, block):]


# Query ------------------------------------------------------------------------------------------------
def test_plain_request_reads_the_whole_log():
    req = cl.parse_log_request("ns", "p", "main", {})
    assert req == cl.LogRequest("ns", "p", "main", tail_lines=None, follow=False, limit_bytes=None)


def test_tail_follow_and_limit_are_parsed_as_the_kubelet_sends_them():
    req = cl.parse_log_request("ns", "p", "c", {"tailLines": "2", "follow": "true", "limitBytes": "100"})
    assert (req.tail_lines, req.follow, req.limit_bytes) == (2, True, 100)
    assert cl.parse_log_request("ns", "p", "c", {"tailLines": "0"}).tail_lines == 0
    assert cl.parse_log_request("ns", "p", "c", {"follow": "0"}).follow is False
    assert cl.parse_log_request("ns", "p", "c", {"follow": "T"}).follow is True


@pytest.mark.parametrize("query, words", [
    ({"previous": "true"}, "previous=true is not supported"),
    ({"timestamps": "true"}, "timestamps=true is not supported"),
    ({"sinceSeconds": "10"}, "sinceSeconds is not supported"),
    ({"sinceTime": "2025-01-01T00:00:00Z"}, "sinceTime is not supported"),
    ({"stream": "Stdout"}, "stream='Stdout' is not supported"),
    ({"tailLines": "-1"}, "tailLines must be 0 or more"),
    ({"tailLines": "two"}, "tailLines='two' is not an integer"),
    ({"follow": "yes"}, "follow='yes' is not a boolean"),
    ({"limitBytes": "0"}, "limitBytes must be 1 or more"),
])
def test_unsupported_or_bad_parameters_are_400_with_the_reason(query, words):
    with pytest.raises(cl.LogRequestError) as err:
        cl.parse_log_request("ns", "p", "c", query)
    assert err.value.status == 400
    assert words in err.value.message


def test_previous_false_and_stream_all_are_accepted():
    req = cl.parse_log_request("ns", "p", "c", {"previous": "false", "stream": "All", "timestamps": "false"})
    assert req.follow is False


@pytest.mark.parametrize("namespace, pod, container", [("ns", "..", "c"), ("", "p", "c"), ("ns", "p", "a/b")])
def test_path_parts_that_could_leave_the_log_directory_are_refused(namespace, pod, container):
    with pytest.raises(cl.LogRequestError) as err:
        cl.parse_log_request(namespace, pod, container, {})
    assert err.value.status == 400


def test_log_directory_name_matches_the_agents_layout():
    assert cl.log_dir_name("ns", "pod-a", "u-1") == "ns_pod-a_u-1"


# Tail -------------------------------------------------------------------------------------------------
def test_tail_gives_the_last_lines():
    data = b"one\ntwo\nthree\nfour\n"
    assert tail(data, 2) == b"three\nfour\n"
    assert tail(data, 1) == b"four\n"
    assert tail(data, 4) == data
    assert tail(data, 10) == data


def test_tail_zero_gives_nothing_and_an_empty_file_gives_nothing():
    assert tail(b"one\ntwo\n", 0) == b""
    assert tail(b"", 3) == b""


def test_a_last_line_still_being_written_counts_as_a_line():
    assert tail(b"one\ntwo\nthr", 1) == b"thr"
    assert tail(b"one\ntwo\nthr", 2) == b"two\nthr"


def test_empty_lines_count():
    assert tail(b"a\n\n\nb\n", 3) == b"\n\nb\n"


def test_tail_scans_back_block_by_block_across_block_edges():
    data = b"".join(f"line {i}\n".encode() for i in range(1000))
    for block in (1, 3, 7, 64, 4096):
        assert tail(data, 3, block) == b"line 997\nline 998\nline 999\n"


def test_tail_reads_only_the_end_of_a_large_file():
    data = b"x" * 1_000_000 + b"\nend 1\nend 2\n"
    reads: list[tuple[int, int]] = []
    start = cl.tail_start(len(data), reader(data, reads), 2, block=1024)
    assert data[start:] == b"end 1\nend 2\n"
    assert sum(length for _, length in reads) <= 1024 + 1


# Limit and follow -------------------------------------------------------------------------------------
def test_limit_bytes_clips_the_last_chunk_and_then_sends_nothing():
    assert cl.clip_to_limit(b"abcdef", 0, None) == b"abcdef"
    assert cl.clip_to_limit(b"abcdef", 0, 4) == b"abcd"
    assert cl.clip_to_limit(b"abcdef", 2, 4) == b"ab"
    assert cl.clip_to_limit(b"abcdef", 4, 4) == b""


def test_follow_sends_new_output_waits_while_running_and_ends_once_drained_after_exit():
    assert cl.follow_step(10, running_before_read=True) is cl.FollowStep.SEND
    assert cl.follow_step(10, running_before_read=False) is cl.FollowStep.SEND  # the last words still go out
    assert cl.follow_step(0, running_before_read=True) is cl.FollowStep.WAIT
    assert cl.follow_step(0, running_before_read=False) is cl.FollowStep.END


# Node status ------------------------------------------------------------------------------------------
def test_node_status_names_the_log_endpoint_and_an_internal_ip():
    status = plan.node_status(ready=True, now="t1", since="t0", capacity={"cpu": "2"}, kubelet_port=43210)
    assert status["daemonEndpoints"] == {"kubeletEndpoint": {"Port": 43210}}
    assert {"type": "InternalIP", "address": "127.0.0.1"} in status["addresses"]


def test_node_status_without_a_log_endpoint_has_no_daemon_endpoints():
    status = plan.node_status(ready=True, now="t1", since="t0", capacity={"cpu": "2"})
    assert "daemonEndpoints" not in status
