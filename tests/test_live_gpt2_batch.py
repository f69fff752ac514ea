"""The batched GPT-2 engine (live.gpt2_batch) on CPU: every sequence of a batch decodes what it
decodes alone.

The model is the tiny configuration with random weights drawn wider than GPT-2's initialisation
(0.3, not 0.02): GPT-2's own init makes a random model repeat one token, under which a wrong cache
could go unseen; this one samples varied tokens, so a row that read another row's KV, a wrong
position or an unmasked pad shows."""

import pytest

pytestmark = pytest.mark.slow  # torch and transformers: seconds to import


@pytest.fixture(scope="module")
def loaded():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from live.gpt2 import TINY
    from live.tokenizer import ByteTokenizer

    torch.set_num_threads(1)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        net = transformers.GPT2LMHeadModel(transformers.GPT2Config(**TINY, initializer_range=0.3))
    return net.eval(), ByteTokenizer(), "cpu"


@pytest.fixture(scope="module")
def solo(loaded):
    from live.gpt2 import GPT2Engine, GPT2Spec

    return GPT2Engine(GPT2Spec("tiny", "cpu"), loaded)


@pytest.fixture
def batch(loaded):
    from live.gpt2 import GPT2Spec
    from live.gpt2_batch import BatchedGPT2

    return BatchedGPT2(GPT2Spec("tiny", "cpu"), loaded)


PROMPTS = (
    "Hello there, my friend",
    "A",
    "The queue in front of the engine is long today and",
    "xyz",
)


def alone(solo, ids, n):
    return solo.greedy_ids(ids, n)


def run(batch, joins, chunk=4, leaves=(), preempts=()):
    """Step until every sequence has finished; joins: {step: [(id, ids, max_new)]}, leaves /
    preempts: {step: id}. Prompts are fed ``chunk`` tokens a step (chunked prefill). Returns each
    sequence's sampled tokens."""
    got: dict = {}
    for step in range(500):
        for seq_id, ids, n in joins.get(step, ()):
            batch.add(seq_id, ids, n)
            got[seq_id] = []
        if step in dict(leaves):
            batch.remove(dict(leaves)[step])
        if step in dict(preempts):
            batch.preempt(dict(preempts)[step])
        if not len(batch) and step > max(joins):
            return got
        plan = {k: min(chunk, batch.remaining(k)) for k in got if k in batch}
        result = batch.step(plan)
        assert result.rows == len(plan) and result.fed_tokens == sum(plan.values())
        for seq_id, out in result.outputs.items():
            got[seq_id].append(out.token)
            assert out.generated == len(got[seq_id])
    raise AssertionError("the batch did not finish")


def test_each_sequence_decodes_as_alone_with_joins_mid_decode(batch, solo):
    ids = [batch.encode(p, 16) for p in PROMPTS]
    joins = {0: [(0, ids[0], 16), (1, ids[1], 9)], 5: [(2, ids[2], 16)], 11: [(3, ids[3], 12)]}
    got = run(batch, joins)
    assert got == {
        0: alone(solo, ids[0], 16),
        1: alone(solo, ids[1], 9),
        2: alone(solo, ids[2], 16),
        3: alone(solo, ids[3], 12),
    }
    assert len(set(got[0])) > 4  # the model samples varied tokens (see the module docstring)
    assert batch.cached_tokens() == 0 and len(batch) == 0


def test_whole_prompts_in_one_step_and_no_plan(batch, solo):
    ids = [batch.encode(p, 10) for p in PROMPTS]
    for k, i in enumerate(ids):
        batch.add(k, i, 10)
    got = {k: [] for k in range(len(ids))}
    while len(batch):
        for k, out in batch.step().outputs.items():  # no plan: every sequence feeds all it has
            got[k].append(out.token)
    assert got == {k: alone(solo, i, 10) for k, i in enumerate(ids)}


def test_a_sequence_that_leaves_early_frees_its_cache_and_the_others_go_on(batch, solo):
    ids = [batch.encode(p, 16) for p in PROMPTS[:3]]
    joins = {0: [(0, ids[0], 16), (1, ids[1], 16), (2, ids[2], 16)]}
    got = run(batch, joins, leaves=((9, 1),))
    assert got[0] == alone(solo, ids[0], 16) and got[2] == alone(solo, ids[2], 16)
    assert 0 < len(got[1]) < 16 and got[1] == alone(solo, ids[1], 16)[: len(got[1])]
    assert 1 not in batch


def test_remove_frees_the_sequence(batch):
    batch.add("a", batch.encode("some prompt", 8), 8)
    batch.add("b", batch.encode("another prompt", 8), 8)
    batch.step()
    held = batch.cached_tokens()
    batch.remove("a")
    assert "a" not in batch and len(batch) == 1
    assert batch.cached_tokens() == held - len("some prompt")
    with pytest.raises(KeyError):
        batch.step({"a": 1})
    batch.remove("a")  # a second remove (it had finished, or was cancelled twice) is harmless
    batch.add("a", batch.encode("x", 4), 4)  # the id may be used again, from nothing
    assert batch.remaining("a") == 1


def test_preempted_sequence_recomputes_and_goes_on_as_alone(batch, solo):
    ids = [batch.encode(p, 16) for p in PROMPTS[:2]]
    got = run(batch, {0: [(0, ids[0], 16), (1, ids[1], 16)]}, preempts=((12, 0),))
    assert got == {0: alone(solo, ids[0], 16), 1: alone(solo, ids[1], 16)}


def test_max_new_tokens_ends_the_sequence_with_its_text(batch, solo):
    ids = batch.encode("Hello", 5)
    batch.add("r", ids, 5)
    outs = []
    while "r" in batch:
        outs.append(batch.step().outputs["r"])
    assert [o.finished for o in outs] == [False] * 4 + [True]
    assert outs[-1].reason == "length" and outs[-1].generated == 5
    assert outs[-1].text == solo.run("Hello", 5).text


@pytest.mark.parametrize("min_tokens", [0, 6])
def test_stop_string_ends_the_sequence_as_the_solo_engine_does(batch, solo, min_tokens):
    from live.engine import Asked

    full = solo.run("Hello there", 20).text
    stop = full[8:10]  # two characters the answer holds (wherever they first appear)
    expected = solo.run("Hello there", 20, stop=[stop], asked=Asked(min_tokens=min_tokens))
    batch.add("r", batch.encode("Hello there", 20), 20, stop=[stop], min_tokens=min_tokens)
    batch.add("other", batch.encode("xyz", 20), 20)
    last = None
    while "r" in batch:
        last = batch.step().outputs.get("r", last)
    assert last.finished and last.reason == "stop"
    assert (last.text, last.generated) == (expected.text, expected.tokens)
    assert last.generated < 20 and "other" in batch


def test_bad_plans_and_sequences_are_refused(batch):
    batch.add("r", batch.encode("Hello", 4), 4)
    with pytest.raises(ValueError, match="already"):
        batch.add("r", [1, 2], 4)
    with pytest.raises(ValueError, match="feed 1..5"):
        batch.step({"r": 6})
    with pytest.raises(ValueError, match="max_new_tokens"):
        batch.add("s", [1], 0)
    with pytest.raises(ValueError, match="exceed the context"):
        batch.add("s", [1] * 1000, 100)
    with pytest.raises(ValueError, match="at least one"):
        batch.add("s", [], 4)
    assert batch.step({}).rows == 0


def test_driven_by_the_queue_cores_batch_plan_each_request_decodes_as_alone(batch, solo):
    """qsim.batch.BatchQueue plans the steps (3 seats, 8 tokens a step: chunked prefill, requests
    waiting for a seat), the engine runs them as planned: every request gets its solo tokens, and
    ends in the step in which the queue core ends it, with as many tokens."""
    from qsim import Batching, ServerConfig, StepModel
    from qsim.batch import BatchQueue
    from qsim.entry import Work
    from qsim.policy import PRESETS

    planned, ended = [], {}
    queue = BatchQueue(
        ServerConfig(
            PRESETS["none"],
            Batching(StepModel(0.01, 0, 0, 0), max_num_seqs=3, max_num_batched_tokens=8),
        ),
        step=lambda plan, now: planned.append(plan),
        end=lambda req, now, outcome, reason, stats: ended.setdefault(req, (step, stats.tokens)),
        drop=lambda *a: pytest.fail(f"dropped {a}"),
        members=True,
    )  # a live driver needs the decoding requests by name
    sizes = {0: 12, 1: 5, 2: 9, 3: 7, 4: 6}
    ids = {k: batch.encode(PROMPTS[k % len(PROMPTS)], n) for k, n in sizes.items()}
    arrivals = {0: [0, 1], 3: [2, 3], 4: [4]}
    got, finished, now = {k: [] for k in sizes}, {}, 0.0
    for step in range(200):
        for k in arrivals.get(step, ()):
            batch.add(k, ids[k], sizes[k])
            assert queue.arrive(k, now, 0.1, work=Work(sizes[k], len(ids[k]), None)) is None
        if not planned:
            break
        plan = planned.pop()
        result = batch.step(
            {req: chunk for req, chunk in plan.chunks} | {req: 1 for req in plan.decoding}
        )
        for k, out in result.outputs.items():
            got[k].append(out.token)
            if out.finished:
                finished[k] = (step, out.generated)
        now += 0.01
        queue.step_done(now, elapsed_s=result.seconds)
    assert got == {k: alone(solo, ids[k], n) for k, n in sizes.items()}
    assert finished == ended and len(batch) == 0


def test_a_step_that_raises_leaves_its_sequences_to_recompute(batch, solo, monkeypatch):
    ids = [batch.encode(p, 12) for p in PROMPTS[:3]]
    for k in range(3):
        batch.add(k, ids[k], 12)
    got = {k: [] for k in range(3)}
    for _ in range(4):
        for k, out in batch.step().outputs.items():
            got[k].append(out.token)
    forward = batch.net.forward
    monkeypatch.setattr(
        batch.net, "forward", lambda *a, **kw: (_ for _ in ()).throw(MemoryError("out of memory"))
    )
    with pytest.raises(MemoryError):
        batch.step({0: 1, 1: 1})  # 2 is not in this step: it keeps its KV
    monkeypatch.setattr(batch.net, "forward", forward)
    assert batch.remaining(0) == len(ids[0]) + 4 and batch.remaining(2) == 1
    while len(batch):
        for k, out in batch.step().outputs.items():
            got[k].append(out.token)
    assert got == {k: alone(solo, ids[k], 12) for k in range(3)}


def test_the_batching_gate_drives_it_preempting_and_streaming(loaded, solo):
    """live.gate.BatchGate (the queue core with KV blocks that bind: preemption) drives
    GPT2BatchEngine from its engine thread: every answer is the solo engine's text (stop strings cut
    the text, not the work), a streamed one's pieces join to it, and the engine holds nothing at the
    end."""
    import asyncio

    from live.batching import is_batch_engine
    from live.gate import BatchGate
    from live.gate import gate_config
    from live.jobs import END, Job
    from live.gpt2 import GPT2Spec
    from live.gpt2_batch import GPT2BatchEngine
    from qsim import PRESETS
    from qsim.engines import Batching, StepModel

    engine = GPT2BatchEngine(GPT2Spec("tiny", "cpu"), loaded)
    assert is_batch_engine(engine)
    preempted, preempt = [], engine.batch.preempt
    engine.batch.preempt = lambda key: preempted.append(key) or preempt(key)
    tight = Batching(
        StepModel(0.01, 0.0001, 0.0002, 0.000001),
        max_num_seqs=4,
        max_num_batched_tokens=16,
        kv_blocks=20,
        block_size=8,
    )
    prompts = [p * 2 for p in PROMPTS]
    stops = {1: [solo.run(prompts[1], 14).text[6:8]]}
    jobs = [
        Job(p, 14, tuple(stops.get(i, ())), prompt_tokens=engine.count_tokens(p), stream=i == 2)
        for i, p in enumerate(prompts)
    ]

    async def go():
        async with BatchGate(engine, gate_config(PRESETS["none"], engine=tight)) as gate:
            plain = [gate.submit(j) for j in jobs if not j.stream]
            streamed = gate.submit_streaming(jobs[2])
            pieces = []
            while (piece := await streamed.pieces.get()) is not END:
                pieces.append(piece)
            return await asyncio.gather(*plain), pieces, await streamed.future, gate.stats()

    answers, pieces, answer, stats = asyncio.run(go())
    answers.insert(2, answer)
    assert [a.text for a in answers] == [
        solo.run(p, 14, stop=stops.get(i)).text for i, p in enumerate(prompts)
    ]
    assert all(a.tokens == 14 for a in answers)  # the core runs each to its limit
    assert "".join(pieces) == answer.text and len(pieces) > 1
    assert stats["counts"]["good"] + stats["counts"].get("late", 0) == 4
    assert len(engine.batch) == 0 and not engine._ids
    assert preempted  # 20 blocks of 8 tokens do not hold the four at their limits


def test_qlab_serve_batching_gpt2_answers_over_http(tmp_path):
    """``qlab serve --batching --engine gpt2 --model tiny``: a burst batched over HTTP gets the
    solo engine's texts."""
    import asyncio

    import httpx

    from live.gpt2 import GPT2Engine, GPT2Spec
    from live.procs import serving
    from live.serve_options import ServeOptions

    options = ServeOptions(
        engine="gpt2",
        model="tiny",
        device="cpu",
        threads=1,
        policy="none",
        batching=True,
        max_num_seqs=4,
        max_num_batched_tokens=32,
        port=0,
    )
    prompts = [f"request {i}: " + "y" * (7 * i + 1) for i in range(6)]
    with serving([options], tmp_path, 120) as (server,):

        async def burst():
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
                return await asyncio.gather(
                    *(
                        http.post("/v1/generate", json={"prompt": p, "max_new_tokens": 8})
                        for p in prompts
                    )
                )

        responses = asyncio.run(burst())
        stats = httpx.get(f"{server.url}/stats", timeout=30).json()
    assert [r.status_code for r in responses] == [200] * 6
    one = GPT2Engine(GPT2Spec("tiny", "cpu", seed=0))
    assert [r.json()["text"] for r in responses] == [one.run(p, 8).text for p in prompts]
    assert stats["engine"]["engine"] == "gpt2-batch" and stats["batching"]["steps"] > 0
