"""The `hf` engine: greedy output equals transformers `generate` token for token (plain,
aborted + resumed elsewhere, under KV pressure), logprobs equal a forward pass, and the
scheduler-facing behaviour (admission, stats, abort, weights, memory release)."""

from __future__ import annotations

import pytest
import torch

from pivot_hpc.engines.base import InferenceEngine, SamplingParams
from pivot_hpc.engines.hf.engine import HFEngine, generate_all
from pivot_hpc.models.qwen2 import create_model

from .conftest import TINY

N = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(tiny_model, prompts):
    out = []
    with torch.no_grad():
        for p in prompts:
            g = tiny_model.generate(
                torch.tensor([p]),
                max_new_tokens=N,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
            out.append(g[0, len(p) :].tolist())
    return out


def test_protocol(tiny_model):
    assert isinstance(HFEngine(tiny_model), InferenceEngine)


def test_greedy_equals_generate(tiny_model, prompts, reference):
    res = generate_all(HFEngine(tiny_model), prompts, GREEDY)
    assert [r.token_ids for r in res] == reference
    assert all(r.finish_reason == "length" for r in res)
    assert len({tuple(t) for t in reference}) > 1  # the outputs are not degenerate


def test_logprobs_match_forward(tiny_model, prompts):
    res = generate_all(HFEngine(tiny_model), prompts, GREEDY)
    worst = 0.0
    with torch.no_grad():
        for r, p in zip(res, prompts, strict=True):
            logits = tiny_model(torch.tensor([p + r.token_ids])).logits[0].float()
            lp = torch.log_softmax(logits, -1)[len(p) - 1 : len(p) + N - 1]
            lp = lp.gather(1, torch.tensor(r.token_ids)[:, None])[:, 0]
            worst = max(worst, (lp - torch.tensor(r.logprobs)).abs().max().item())
    assert worst <= 1e-4


def test_abort_and_resume_elsewhere(tiny_model, prompts, reference):
    a, b = HFEngine(tiny_model), HFEngine(tiny_model)
    for i, p in enumerate(prompts):
        a.add(i, p, sampling=GREEDY)
    for _ in range(5):
        assert a.step() == []
    done = {}
    for i in range(0, len(prompts), 2):  # migrate half mid-generation
        r = a.abort(i)
        assert r.finish_reason == "abort" and 0 < len(r.token_ids) < N
        assert r.token_ids == reference[i][: len(r.token_ids)]
        b.add(i, prompts[i], r.token_ids, GREEDY, r.logprobs)
    for _ in range(3):
        done.update({r.seq_id: r for r in a.step()})
    for i in range(1, len(prompts), 2):  # …and the other half a few steps later
        r = a.abort(i)
        b.add(i, prompts[i], r.token_ids, GREEDY, r.logprobs)
    assert not a.has_unfinished()
    while b.has_unfinished():
        done.update({r.seq_id: r for r in b.step()})
    assert [done[i].token_ids for i in range(len(prompts))] == reference
    assert all(len(done[i].logprobs) == N for i in done)


def test_kv_pressure_preempts_and_stays_exact(tiny_model, prompts, reference):
    cap = 90  # far below the ~10 × 40 tokens the batch needs at the end
    e = HFEngine(tiny_model, kv_capacity_tokens=cap)
    for i, p in enumerate(prompts):
        e.add(i, p, sampling=GREEDY)
    out, peak = {}, 0
    while e.has_unfinished():
        out.update({r.seq_id: r for r in e.step()})
        st = e.stats()
        peak = max(peak, st.tokens_in_cache)
        assert st.tokens_in_cache <= cap
    assert [out[i].token_ids for i in range(len(prompts))] == reference
    assert e.stats().preemptions > 0 and peak > cap // 2


def test_admission_and_stats(tiny_model):
    e = HFEngine(tiny_model, kv_capacity_tokens=50, max_batch=2)
    sp = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    assert e.can_admit(20)
    for i in range(3):
        e.add(i, list(range(3, 23)), sampling=sp)
    e.step()
    st = e.stats()
    assert (st.running, st.waiting, st.kv_capacity) == (2, 1, 50)
    assert st.tokens_in_cache == 2 * 21 and st.last_step_s > 0
    assert not e.can_admit(20)
    with pytest.raises(ValueError):
        e.add(9, list(range(3, 60)), sampling=sp)  # can never fit
    with pytest.raises(ValueError):
        e.add(0, [5], sampling=sp)  # duplicate id


def test_stop_tokens_and_strings(tiny_model, prompts, reference):
    stop_tok = reference[0][3]
    e = HFEngine(tiny_model)
    [r] = generate_all(
        e, [prompts[0]], SamplingParams(temperature=0, max_tokens=N, stop_token_ids=(stop_tok,))
    )
    first = reference[0].index(stop_tok)
    assert r.finish_reason == "stop" and r.token_ids == reference[0][: first + 1]

    class CharTok:
        def decode(self, ids):
            return "".join(chr(65 + i % 26) for i in ids)

    text = CharTok().decode(reference[1])
    e = HFEngine(tiny_model, tokenizer=CharTok())
    [r] = generate_all(
        e, [prompts[1]], SamplingParams(temperature=0, max_tokens=N, stop=(text[4:6],))
    )
    assert r.finish_reason == "stop" and CharTok().decode(r.token_ids).endswith(text[4:6])


def test_sampling_seeded_and_top_p(tiny_model, prompts):
    sp = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=N, ignore_eos=True)
    r1 = generate_all(HFEngine(tiny_model, seed=1), prompts, sp)
    r2 = generate_all(HFEngine(tiny_model, seed=1), prompts, sp)
    assert [r.token_ids for r in r1] == [r.token_ids for r in r2]
    assert all(lp <= 0 for r in r1 for lp in r.logprobs)
    # top_p → 0 keeps only the most likely token: sampling becomes greedy
    tiny_p = SamplingParams(temperature=1.0, top_p=1e-6, max_tokens=N, ignore_eos=True)
    greedy = generate_all(HFEngine(tiny_model), prompts, GREEDY)
    assert [r.token_ids for r in generate_all(HFEngine(tiny_model), prompts, tiny_p)] == [
        r.token_ids for r in greedy
    ]


def test_load_weights_in_place_and_versions(tiny_model, prompts):
    other = create_model(TINY, seed=11)
    e = HFEngine(create_model(TINY, seed=3))
    ptr = e.model.model.embed_tokens.weight.data_ptr()
    e.load_weights(dict(other.state_dict()), version=7)
    assert e.model.model.embed_tokens.weight.data_ptr() == ptr
    [r] = generate_all(e, [prompts[0]], GREEDY)
    [ref] = generate_all(HFEngine(other), [prompts[0]], GREEDY)
    assert r.token_ids == ref.token_ids and r.version == 7
    with pytest.raises(KeyError):
        e.load_weights({"nope": torch.zeros(1)}, version=8)


def test_release_and_resume_memory(tiny_model, prompts):
    weights = {k: v.clone() for k, v in tiny_model.state_dict().items()}
    e = HFEngine(create_model(TINY, seed=3))
    [before] = generate_all(e, [prompts[2]], GREEDY)
    e.add(99, prompts[2], sampling=GREEDY)
    with pytest.raises(RuntimeError):
        e.release_memory()  # not idle
    e.abort(99)
    e.release_memory(weights=True)
    assert e._k is None and e.model.lm_head.weight.numel() == 0
    with pytest.raises(RuntimeError):
        e.step()
    e.resume_memory()
    e.load_weights(weights, version=1)
    [after] = generate_all(e, [prompts[2]], GREEDY, first_id=5)
    assert after.token_ids == before.token_ids


def test_resumed_sequence_at_max_tokens_finishes_without_model(tiny_model):
    e = HFEngine(tiny_model)
    sp = SamplingParams(temperature=0.0, max_tokens=3)
    e.add(1, [5, 6], [7, 8, 9], sp)
    [r] = e.step()
    assert r.finish_reason == "length" and r.token_ids == [7, 8, 9]


def test_sequence_longer_than_capacity_ends_as_length(tiny_model, prompts, reference):
    e = HFEngine(tiny_model, kv_capacity_tokens=len(prompts[0]) + 10)
    [r] = generate_all(
        e, [prompts[0]], SamplingParams(temperature=0, max_tokens=N, ignore_eos=True)
    )
    assert r.finish_reason == "length"
    # capacity counts cached tokens; the last sampled token is not cached yet
    assert r.token_ids == reference[0][: len(r.token_ids)] and len(r.token_ids) == 11
    assert not e.has_unfinished()


def test_one_bounded_prefill_per_step_and_exact_output(tiny_model, prompts, reference):
    """prefill_chunk_tokens bounds what one step prefills (a step stays short, so a command
    waits little for the engine), at least one sequence per step; the output is unchanged."""
    e = HFEngine(tiny_model, prefill_chunk_tokens=1)
    for i, p in enumerate(prompts):
        e.add(i, p, sampling=GREEDY)
    for k in (1, 2, 3):
        e.step()
        st = e.stats()
        assert (st.running, st.waiting) == (k, len(prompts) - k)
        assert (st.last_step_seqs, st.last_step_tokens) == (k, st.tokens_in_cache)
    roomy = max(len(p) for p in prompts) * len(prompts)
    for chunk in (1, roomy):
        out = generate_all(HFEngine(tiny_model, prefill_chunk_tokens=chunk), prompts, GREEDY)
        assert [r.token_ids for r in out] == reference
