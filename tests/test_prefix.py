"""Prefix caching in the batching engine (qsim.prefix, qsim.batch): vLLM v1's block hashing,
sharing, LRU eviction and its counters, checked by hand on small cases and audited at every step on
random ones."""

import dataclasses
import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qsim import Batching, ServerConfig, StepModel, make_trace, records, simulate, testing
from qsim.batch import BatchQueue
from qsim.entry import Work
from qsim.policy import PRESETS
from qsim.prefix import SYSTEM_KEY, BlockPool, Tokens, answer_key, block_hashes, own_key
from qsim.testing import EngineSettings, SimRun
from qsim.mixes import Prompts, SharedPrefix
from qsim.trace import from_arrays
from qsim.workload import trace_chunks

#: A step's time says how many prompt tokens it computed: 10 ms + 1 ms per prefill token.
PREFILL_STEP = StepModel(b0=0.01, b1=0.001, b2=0.0, b3=0.0)
SYSTEM = (SYSTEM_KEY, 48)  # a system prompt of three full blocks of 16


def trace_of(arrival, prompts, out):
    """Requests at ``arrival`` whose prompts are these segments (own tokens: (own_key(i), n))."""
    tokens = np.empty(len(arrival), dtype=object)
    for i, segments in enumerate(prompts):
        tokens[i] = Tokens(tuple(segments), answer_key(i))
    trace = from_arrays(np.asarray(arrival, float), np.asarray(out))
    lengths = [sum(n for _, n in segments) for segments in prompts]
    return dataclasses.replace(
        trace,
        prompt_tokens=np.asarray(lengths, dtype=np.int64),
        tokens_generated=np.asarray(out, dtype=np.int64),
        tokens=tokens,
    )


def run(trace, caching=True, **engine):
    engine = Batching(PREFILL_STEP, prefix_caching=caching, **engine)
    config = ServerConfig(PRESETS["none"], engine)
    with testing.audited_batches():  # the pool's books, each block's holders, at every step
        return records.validate(simulate(trace, config))


class Driver:
    """The batch core on a hand-turned clock: each step ends 10 ms after it starts."""

    def __init__(self, tokens: dict, **engine):
        self.plans, self.ended = [], {}
        config = ServerConfig(PRESETS["none"], Batching(StepModel(0.01, 0, 0, 0), **engine))
        self.queue = BatchQueue(
            config,
            step=lambda plan, now: self.plans.append(plan),
            end=self._end,
            drop=lambda *a: None,
            tokens=tokens.get,
        )
        self.now = 0.0

    def _end(self, req, now, outcome, reason, stats):
        self.ended[req] = stats

    def arrive(self, req, prompt: int, out: int) -> None:
        assert self.queue.arrive(req, self.now, 1.0, 100.0, work=Work(out, prompt, out)) is None

    def step(self) -> None:
        self.now += 0.01
        self.queue.step_done(self.now)
        self.queue.audit()

    def run(self) -> None:
        while self.queue.plan is not None:
            self.step()


# ---------------------------------------------------------------- by hand


def test_a_shared_three_block_prefix_is_computed_once_and_the_second_prefills_its_tail():
    # A: 48 system tokens + 8 of its own, in one step of 56 prefill tokens; B, after A has ended,
    # finds the three full system blocks cached and prefills its own 8 only.
    trace = trace_of([0.0, 1.0], [[SYSTEM, (own_key(0), 8)], [SYSTEM, (own_key(1), 8)]], [2, 2])
    df = run(trace)
    assert df["ttft_s"].tolist() == pytest.approx([0.01 + 0.056, 0.01 + 0.008])
    assert df["cached_prompt_tokens"].tolist() == [0, 48]
    # vLLM's counters: each scheduling queries its prompt's tokens and hits what it found cached.
    assert (df.attrs["prefix_cache_queries"], df.attrs["prefix_cache_hits"]) == (56 + 56, 48)
    off = run(trace, caching=False)
    assert off["ttft_s"].tolist() == pytest.approx([0.066, 0.066])
    assert off["cached_prompt_tokens"].isna().all() and "prefix_cache_hits" not in off.attrs


def test_cached_blocks_are_shared_with_a_reference_count_not_allocated_again():
    # Both at once: A's blocks are cached when its step is scheduled, so B (joining while it runs)
    # shares the three system blocks: 4 + 1 blocks in use, not 4 + 4.
    tokens = {
        "a": Tokens((SYSTEM, (own_key(0), 8)), answer_key(0)),
        "b": Tokens((SYSTEM, (own_key(1), 8)), answer_key(1)),
    }
    driver = Driver(tokens, prefix_caching=True)
    driver.arrive("a", 56, 3)
    driver.arrive("b", 56, 3)
    pool, queue = driver.queue.pool, driver.queue
    a, b = (queue.running[k].table for k in (1, 2))
    assert a[:3] == b[:3] and a[3] != b[3]
    assert [pool.ref[x] for x in a] == [2, 2, 2, 1] and queue.kv_used == 5
    assert driver.plans[0].chunks == (("a", 56),)
    driver.step()
    assert driver.plans[1].chunks == (("b", 8),)  # its 48 shared tokens are not computed again
    driver.run()
    assert driver.ended["b"].cached_tokens == 48 and queue.kv_used == 0 and not pool.ref
    # Freed, the full blocks stay cached: a's three system blocks, a's and b's 4th (8 + 2 answer
    # tokens: partial, never cached) are not.
    assert all(pool.hash_of.get(x) is not None for x in a[:3]) and a[3] not in pool.hash_of


def _evicted(last):
    """A and B (32 tokens each: two full blocks) end, in that order, on a cache of 4 blocks; C (16
    tokens) needs one block, and then ``last`` asks for A's or B's prompt and one more token."""
    prompts = [[(own_key(0), 32)], [(own_key(1), 32)], [(own_key(2), 16)], [*last, (own_key(3), 1)]]
    return run(trace_of([0.0, 1.0, 2.0, 3.0], prompts, [1, 1, 1, 1]), kv_blocks=4)


def test_freed_blocks_are_evicted_least_recently_freed_first_and_a_request_s_tail_first():
    # The free queue after A and B: [A1, A0, B1, B0] (a request's blocks are freed last first). C
    # takes the head, A's second block: A's prefix keeps its first block, B's both.
    again_a = _evicted([(own_key(0), 32)])
    again_b = _evicted([(own_key(1), 32)])
    assert again_a["cached_prompt_tokens"].tolist() == [0, 0, 0, 16]
    assert again_b["cached_prompt_tokens"].tolist() == [0, 0, 0, 32]
    assert again_a["ttft_s"].iloc[3] == pytest.approx(0.01 + 0.001 * (33 - 16))


def test_a_preempted_request_recomputes_only_what_was_evicted():
    # Five blocks; r1 and r2 (32 tokens each, 20 to generate) join at once. r2 is preempted when
    # both need a third block; r1's fourth then evicts r2's second block (the tail of the free
    # queue's head request), so r2, scheduled again with 33 tokens (its prompt and its first
    # token), finds 16 cached: 17 to compute.
    tokens = {f"r{i + 1}": Tokens(((own_key(i), 32),), answer_key(i)) for i in (0, 1)}
    chunks = {}
    for caching in (True, False):
        driver = Driver(
            tokens, kv_blocks=5, max_num_seqs=4, max_num_batched_tokens=64, prefix_caching=caching
        )
        driver.arrive("r1", 32, 20)
        driver.arrive("r2", 32, 20)
        driver.run()
        assert driver.ended["r2"].preemptions == 1 and driver.ended["r1"].preemptions == 0
        chunks[caching] = [c for plan in driver.plans for c in plan.chunks if c[0] == "r2"]
    assert chunks[True] == [("r2", 32), ("r2", 17)]
    assert chunks[False] == [("r2", 32), ("r2", 33)]


def test_a_partial_last_block_is_never_cached_and_the_last_token_is_always_computed():
    # A's 40 tokens: two full blocks and a partial one (8). B repeats A's 40 and adds 10: it finds
    # 32, not 40. C repeats A's 32 exactly: at most 31 tokens may hit (its last is computed for its
    # logits), so 16.
    a = (own_key(0), 40)
    prompts = [[a], [a, (own_key(1), 10)], [(own_key(0), 32)]]
    df = run(trace_of([0.0, 1.0, 2.0], prompts, [1, 1, 1]))
    assert df["cached_prompt_tokens"].tolist() == [0, 32, 16]


def test_a_block_s_hash_depends_on_everything_before_it():
    first = list(zip(block_hashes(Tokens(((5, 16), (7, 16)), 9), 16), range(2)))
    other = list(zip(block_hashes(Tokens(((6, 16), (7, 16)), 9), 16), range(2)))
    # The second blocks hold the same tokens (7's first 16) after different first blocks: different
    # hashes.
    assert first[0] != other[0] and first[1] != other[1]
    again = list(zip(block_hashes(Tokens(((5, 16), (7, 20)), 3), 16), range(2)))
    assert again == first  # the same tokens, whatever follows them


def test_the_pool_evicts_from_the_head_and_counts_in_tokens():
    pool = BlockPool(3)
    x = pool.allocate(2)
    pool.cache(x[0], 101)
    pool.cache(x[1], 102)
    assert pool.release(reversed(x)) == 2 and list(pool.free) == [x[1], x[0]]
    assert pool.lookup([101, 102, 103], 49, 16) == x  # 48 tokens may hit: three blocks, two cached
    assert (pool.queries, pool.hits) == (49, 32)
    y = pool.allocate(2)  # the fresh block first, then the head of the free queue: x[1], evicted
    assert y[1] == x[1] and pool.lookup([101, 102], 49, 16, count=False) == [x[0]]
    assert pool.evictions == 1 and pool.touch([x[0]]) == 1 and not pool.free


def test_caching_that_finds_nothing_shared_changes_no_row():
    # Prompts of their own on unlimited memory: nothing is ever hit, so every row is what it was.
    trace = make_trace(
        load=2.0, seconds=10, seed=4, prompts=Prompts.parse("uniform:0:200"), capacity_rps=40.0
    )
    engine = dict(max_num_seqs=16, max_num_batched_tokens=256)
    on, off = run(trace, True, **engine), run(trace, False, **engine)
    assert on.attrs["prefix_cache_hits"] == 0 and on["cached_prompt_tokens"].dropna().eq(0).all()
    for column in (c for c in records.COLUMNS if c != "cached_prompt_tokens"):
        assert (
            on[column].astype(object).fillna("-").tolist()
            == off[column].astype(object).fillna("-").tolist()
        ), column


# ---------------------------------------------------------------- shared prefixes in a workload


def test_a_conversation_s_turn_extends_the_one_before_with_its_answer():
    rng = np.random.default_rng(0)
    shared = SharedPrefix(system_tokens=32, system_share=1.0, turns=3, conversations=2)
    own, answers = np.array([5, 6, 7, 8, 9, 10, 11]), np.array([3, 4, 5, 6, 7, 8, 9])
    prompts, ids = shared.compose(rng, own, answers)
    # Requests 0, 2, 4 are conversation 0's turns; 1, 3, 5 conversation 1's; 6 starts a new one in
    # slot 0.
    assert ids[4].prompt == (
        (SYSTEM_KEY, 32),
        (own_key(0), 5),
        (answer_key(0), 3),
        (own_key(2), 7),
        (answer_key(2), 5),
        (own_key(4), 9),
    )
    assert ids[6].prompt == ((SYSTEM_KEY, 32), (own_key(6), 11))
    # 32 + 5; 32 + 6; then each turn: the one before, its answer, its own tokens.
    assert prompts.tolist() == [37, 38, 37 + 3 + 7, 38 + 4 + 8, 47 + 5 + 9, 50 + 6 + 10, 32 + 11]


def test_a_turn_finds_its_conversation_s_history_cached_when_the_turn_before_has_ended():
    shared = SharedPrefix(256, 0.8, turns=4, conversations=16)
    # 3 requests a second: a turn follows the one before about 5 s later, mostly after its answer.
    trace = make_trace(
        load=1.0,
        seconds=60,
        seed=3,
        prompts=Prompts.parse("uniform:16:64"),
        capacity_rps=3.0,
        prefixes=shared,
    )
    df = run(trace, max_num_seqs=32)  # unlimited memory: nothing is evicted
    columns = ("cached_prompt_tokens", "finish_s", "arrival_s")
    cached, finish, arrival = (df[c].to_numpy() for c in columns)
    checked = 0
    for i in range(16, len(df)):
        before = i - 16  # the turn before, in the same slot
        if (i // 16) % 4 == 0 or finish[before] > arrival[i]:
            continue  # a first turn, or one sent before the answer it extends was complete
        # Computed before: its prompt and its answer but the last token (sampled, never fed back).
        computed = trace.prompt_tokens[before] + trace.tokens_generated[before] - 1
        assert cached[i] == 16 * min(computed // 16, (trace.prompt_tokens[i] - 1) // 16), i
        checked += 1
    assert checked > 100
    hits, queries = df.attrs["prefix_cache_hits"], df.attrs["prefix_cache_queries"]
    # No request waited at the head of the line: each was looked up once.
    assert 0.5 < hits / queries < 1 and df["cached_prompt_tokens"].sum() == hits


def test_shared_prefixes_draw_nothing_else_differently():
    plain = make_trace(load=1.0, seconds=10, seed=5, prompts=Prompts.parse("fixed:20"))
    shared = make_trace(
        load=1.0,
        seconds=10,
        seed=5,
        prompts=Prompts.parse("fixed:20"),
        prefixes=SharedPrefix(100, 0.5),
    )
    assert np.array_equal(plain.arrival_s, shared.arrival_s)
    assert np.array_equal(plain.max_new_tokens, shared.max_new_tokens)
    assert set(shared.prompt_tokens - plain.prompt_tokens) == {0, 100}
    assert make_trace(load=1.0, seconds=10, seed=5, prefixes=SharedPrefix()).tokens is None


def test_bad_shared_prefix_specs_say_what_is_wrong():
    with pytest.raises(ValueError, match="TOKENS:SHARE"):
        SharedPrefix.parse("512")
    with pytest.raises(ValueError, match=r"share is in \[0, 1\]"):
        SharedPrefix.parse("512:1.5")
    with pytest.raises(ValueError, match="turns must be"):
        SharedPrefix.parse("none", "0")
    with pytest.raises(ValueError, match="does not stream"):
        trace_chunks(100, load=1.0, seconds=5, prefixes=SharedPrefix(16, 1.0))


# ---------------------------------------------------------------- random cases


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    engine=testing.batching_engines(16, prefix_caching=True),
    seed=st.integers(0, 10_000),
    load=st.sampled_from([0.5, 2.0, 6.0]),
    system=st.sampled_from(["none", "64:0.5", "200:1.0"]),
    turns=st.sampled_from(["1", "3:4"]),
    name=st.sampled_from(["none", "predictive", "predictive-kv", "vllm-caps"]),
)
def test_every_request_ends_once_and_the_blocks_in_use_never_exceed_the_cache(
    engine, seed, load, system, turns, name
):
    policy = PRESETS[name]
    sim = SimRun(policy, EngineSettings(batching=engine))
    trace = make_trace(
        load=load,
        requests=120,
        seed=seed,
        prompts=Prompts.parse("uniform:0:80"),
        capacity_rps=engine.capacity_rps(100.0, 20.0),
        prefixes=SharedPrefix.parse(system, turns),
    )
    # Audited at every step: the pool's books, each block's holders, the blocks in use.
    df = records.validate(sim.simulate(trace))
    testing.check_records(df, sim, trace)
    ran = df["cached_prompt_tokens"].notna()
    assert ran.eq(df["start_s"].notna()).all()
    prompts = trace.prompt_tokens[df.loc[ran, "request_id"]]
    assert (df.loc[ran, "cached_prompt_tokens"] < np.maximum(prompts, 1)).all()
    assert 0 <= df.attrs["prefix_cache_hits"] <= df.attrs["prefix_cache_queries"]


# ---------------------------------------------------------------- the command line and sweeps


def test_simulate_takes_the_prefix_cache_and_shared_prompts(capsys):
    from experiments import cli

    args = [
        "simulate",
        "--batching",
        "--kv-blocks",
        "500",
        "--prompts",
        "uniform:16:64",
        "--system-prompt",
        "256:0.9",
        "--turns",
        "3:8",
        "--prefix-caching",
        "--seconds",
        "10",
        "--load",
        "0.3",
        "--json",
    ]
    assert cli.main(args) == 0
    summary = json.loads(capsys.readouterr().out)["summary"]
    assert 0.5 < summary["prefix_cache_hit_rate"] < 1
    assert summary["prefix_cache_hits"] <= summary["prefix_cache_queries"]
    assert cli.main([a for a in args if a != "--prefix-caching"]) == 0
    assert "prefix_cache_hit_rate" not in json.loads(capsys.readouterr().out)["summary"]


@pytest.mark.parametrize(
    "bad, message",
    [
        (["--prefix-caching"], "--prefix-caching is a batching engine's: add --batching"),
        (["--batching", "--system-prompt", "512"], "expected TOKENS:SHARE"),
        (["--batching", "--turns", "x"], "expected TURNS or TURNS:CONVERSATIONS"),
        (
            ["--batching", "--turns", "2", "--trace", "data/azure_llm_2023_code.csv"],
            "apply to synthetic arrivals only",
        ),
    ],
)
def test_bad_prefix_options_are_one_line_and_exit_2(capsys, bad, message):
    from experiments import cli

    with pytest.raises(SystemExit) as exit_:
        code = cli.main(["simulate", "--seconds", "5", *bad])
        raise SystemExit(code)
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 2 and message in err and len(err.splitlines()) == 1


SWEEP = """
[sweep]
duration_s = 8
seeds = 1
prompts = "uniform:16:64"
system_prompt = "256:0.8"
[batching]
b0 = 0.008
b1 = 5e-05
b2 = 0.0001
kv_blocks = 400
[grid]
policy = ["none"]
load = [0.5]
prefix_caching = [false, true]
turns = ["1", "3:8"]
"""


def test_a_sweep_has_prefix_caching_and_shared_prompt_axes(tmp_path):
    from experiments import config, sweep

    path = tmp_path / "p.toml"
    path.write_text(SWEEP)
    cfg = config.load(path)
    summary = sweep.run(cfg, tmp_path / "out", workers=1, quiet=True)
    assert len(summary) == 4 and set(summary["turns"]) == {"1", "3:8"}
    on = summary[summary["prefix_caching"]]
    off = summary[~summary["prefix_caching"]]
    assert on["prefix_cache_hit_rate"].between(0.3, 1).all()
    assert off["prefix_cache_hit_rate"].isna().all()
    # The cache changes only what the engine does: the same requests arrive in both.
    assert on["requests"].tolist() == off["requests"].tolist()
    assert cfg.canonical()["system_prompt"] == "256:0.8"
    bad = tmp_path / "bad.toml"
    bad.write_text(SWEEP.replace('turns = ["1", "3:8"]', 'turns = ["0"]'))
    with pytest.raises(config.ConfigError, match="grid.turns"):
        config.load(bad)


def test_token_identities_must_add_up_to_the_prompt():
    trace = trace_of([0.0], [[(own_key(0), 8)]], [2])
    bad = dataclasses.replace(trace, prompt_tokens=np.array([9]))
    with pytest.raises(ValueError, match="do not add up to its 9 prompt tokens"):
        simulate(bad, ServerConfig(PRESETS["none"], Batching(prefix_caching=True)))


def test_tokens_spec_round_trips_and_a_bad_one_is_named():
    from qsim.prefix import Tokens

    t = Tokens(((1, 96), (10, 40)), 11)
    assert t.spec() == "1:96,10:40;11" and Tokens.parse(t.spec()) == t
    assert Tokens.parse(";7") == Tokens((), 7)
    assert t.first(100) == Tokens(((1, 96), (10, 4)), 11)
    with pytest.raises(ValueError, match="bad prompt segments"):
        Tokens.parse("1:-3;4")


def test_rendered_ids_share_exactly_what_the_keys_share():
    from qsim.prefix import TokenIds, Tokens, answer_ids, render_ids

    a = Tokens(((1, 20), (2, 5)), 3)
    b = Tokens(((1, 20), (2, 5), (3, 8), (4, 2)), 5)  # a's prompt, its answer, its own
    c = Tokens(((1, 12),), 7)
    ids = render_ids([a, b, c], vocab=1000, salt=9)
    assert ids[1][:25] == ids[0] and ids[2] == ids[0][:12]
    assert ids[1][25:33] == answer_ids(TokenIds.of(ids[0]).answer, 0, 8)
    assert all(16 <= i < 1000 for i in ids[0] + ids[1][33:])  # drawn runs; answers: the engine's
    assert render_ids([a], vocab=1000, salt=10)[0] != ids[0]  # another run's salt
