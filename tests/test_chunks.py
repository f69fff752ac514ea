"""A synthetic trace drawn a chunk at a time is make_trace's trace, value for value (qsim.chunks,
TracePlan.chunks)."""

import numpy as np
import pytest

from qsim.clients import Patience
from qsim.mixes import Client, Mix, Prompts, UsedShare
from qsim.workload import make_trace, plan_trace, trace_chunks

ARRAYS = (
    "arrival_s",
    "max_new_tokens",
    "size_class",
    "est_service_s",
    "true_service_s",
    "deadline_s",
    "prompt_tokens",
    "priority",
    "client_id",
    "patience_s",
    "tokens_generated",
)

CASES = {
    "poisson requests": dict(arrivals="poisson", requests=2003),
    "poisson seconds": dict(arrivals="poisson", seconds=120.0, load=1.3),
    "gamma, noise": dict(arrivals="gamma:3", seconds=60.0, noise_cv=0.5),
    "constant, exponential service": dict(
        arrivals="constant", requests=1500, service="exponential"
    ),
    "deterministic service": dict(arrivals="poisson", seconds=40.0, service="deterministic"),
    "surge seconds": dict(arrivals="surge:10:20:3", seconds=60.0),
    "surge requests": dict(arrivals="surge:10:20:3", requests=900),
    "burst": dict(arrivals="burst:700", requests=1),
    "periodic": dict(arrivals="periodic:7:2.5", seconds=90.0),
    "periodic at a load": dict(arrivals="periodic:2.5", seconds=90.0, load=1.3),
    # Streams drawn in more than one block: early stops draw a uniform then a normal for every
    # request.
    "early stops, prompts, patience": dict(
        arrivals="poisson",
        seconds=80.0,
        used=UsedShare(),
        prompts=Prompts.parse("lognormal:100:0.5"),
        patience=Patience.parse("lognormal:3:1"),
    ),
    "clients, early stops by size": dict(
        arrivals="poisson",
        seconds=80.0,
        prompts=Prompts.parse("uniform:3:900"),
        used={16: UsedShare(), 64: UsedShare(0.1, 0.3, 0.5)},
        clients=(Client("a", 0.3, 1, Mix((8, 32), (0.5, 0.5))), Client("b", 0.7)),
        patience=Patience.parse("exponential:2"),
    ),
}


def joined(chunks) -> dict:
    parts = list(chunks)
    return {name: np.concatenate([getattr(p, name) for p in parts]) for name in ARRAYS}


@pytest.mark.parametrize("size", [1, 7, 256, 10**6])
@pytest.mark.parametrize("case", list(CASES))
def test_a_trace_drawn_in_chunks_is_the_trace_drawn_whole(case, size):
    options = CASES[case]
    whole = make_trace(**options)
    chunks = trace_chunks(size, **options)
    assert (chunks.requests, chunks.duration_s, chunks.meta, chunks.name) == (
        len(whole),
        whole.duration_s,
        whole.meta,
        whole.name,
    )
    parts = list(chunks)
    assert [len(p) for p in parts[:-1]] == [size] * (len(parts) - 1) and 0 < len(parts[-1]) <= size
    assert all(p.duration_s == whole.duration_s and p.meta == whole.meta for p in parts)
    got = joined(parts)
    for name in ARRAYS:
        want = getattr(whole, name)
        if want.dtype == object:
            assert list(got[name]) == list(want), name
        else:
            np.testing.assert_array_equal(got[name], want, err_msg=name)  # exactly: no tolerance


def test_chunks_draw_again_from_the_start_each_time():
    chunks = plan_trace("poisson", seconds=30.0, used=UsedShare(), seed=4).chunks(100)
    first, second = joined(chunks), joined(chunks)
    for name in ARRAYS:
        np.testing.assert_array_equal(first[name], second[name])


def test_a_trace_in_memory_cut_into_chunks():
    trace = make_trace("poisson", seconds=20.0, patience=Patience.parse("exponential:2"), seed=2)
    chunks = trace.chunks(64)
    assert chunks.requests == len(trace) and chunks.duration_s == trace.duration_s
    parts = list(chunks)
    assert [len(p) for p in parts[:-1]] == [64] * (len(parts) - 1)
    got = joined(parts)
    for name in ARRAYS:
        assert got[name].tolist() == getattr(trace, name).tolist() or name == "deadline_s", name
    np.testing.assert_array_equal(got["deadline_s"], trace.deadline_s)  # NaN: the policy's default
    part = trace.rows(3, 9)
    assert (
        part.request_id.tolist() == list(range(6))
        and part.arrival_s.tolist() == trace.arrival_s[3:9].tolist()
    )


@pytest.mark.parametrize("size", [0, -3, 2.5, None])
def test_a_chunk_holds_a_whole_number_of_requests(size):
    with pytest.raises(ValueError, match="whole number >= 1"):
        trace_chunks(size, arrivals="poisson", requests=10)
    with pytest.raises(ValueError, match="whole number >= 1"):
        make_trace("poisson", requests=10).chunks(size)
