"""The prompt (prefix) cache: PrefixCache on its own (matching, trimming, LRU by bytes, stats), then
the text engine on the tiny real model, where a request that reuses an earlier one's prefix must give
what the same request gives on a fresh engine with the cache off."""

from __future__ import annotations

import random
import time

import mlx.core as mx
import pytest

import worker  # noqa: F401  (OpenBLAS before MLX)
from mlx_lm import load
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache

from tests.reference import run_all
from worker.engines.fake import FakeEngine
from worker.engines.text import TextEngine
from worker.engines.prefix_cache import SPECULATIVE_PROBATION, SPECULATIVE_SAMPLE, PrefixCache, unsupported_reason
from worker.scheduler import BatchScheduler

MIB = 1 << 20


# --- PrefixCache on its own ----------------------------------------------------------------------
def kv(tokens: list[int], layers: int = 2) -> list[KVCache]:
    """A cache whose key at position t is tokens[t] (so trimming and copying can be checked)."""
    caches = []
    for _ in range(layers):
        c = KVCache()
        x = mx.array(tokens, dtype=mx.float32).reshape(1, 1, len(tokens), 1)
        c.update_and_fetch(x, x)
        caches.append(c)
    mx.eval([c.state for c in caches])
    return caches


def held(cache: list[KVCache]) -> list[int]:
    keys, _ = cache[0].keys_and_values()
    return [int(v) for v in keys.reshape(-1).tolist()]


def seq(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def test_longest_common_prefix_wins_and_comes_back_trimmed():
    pc = PrefixCache(64 * MIB, min_match=16)
    a = seq(1000, 64)
    b = a[:40] + seq(5000, 24)  # shares 40 tokens with a
    assert pc.store(a, kv(a)) and pc.store(b, kv(b))
    prompt = a[:50] + seq(9000, 30)  # shares 50 with a, 40 with b
    cache, matched = pc.lookup(prompt)
    assert matched == 50
    assert all(c.size() == 50 for c in cache) and held(cache) == a[:50]
    cache, matched = pc.lookup(b[:45] + [7, 7, 7])
    assert matched == 45 and held(cache) == b[:45]


def test_at_least_one_prompt_token_is_left_to_run():
    pc = PrefixCache(64 * MIB, min_match=16)
    a = seq(100, 64)
    pc.store(a, kv(a))
    assert pc.lookup(a)[1] == 63  # the whole entry is the prompt: its last token must still run
    assert pc.lookup(a + [1])[1] == 64
    assert pc.lookup(a[:30])[1] == 29


def test_short_matches_are_ignored():
    pc = PrefixCache(64 * MIB, min_match=32, block_size=16)
    a = seq(100, 64)
    pc.store(a, kv(a))
    assert pc.lookup(a[:20] + seq(900, 40)) is None
    assert pc.lookup(a[:31] + seq(900, 40)) is None
    assert pc.lookup(a[:32] + seq(900, 40))[1] == 32
    assert not pc.store(seq(1, 20), kv(seq(1, 20)))  # shorter than a useful match: not kept


def test_lookups_hand_out_copies_the_batch_may_change():
    pc = PrefixCache(64 * MIB, min_match=16)
    a = seq(100, 48)
    pc.store(a, kv(a))
    cache, matched = pc.lookup(a[:40] + [1, 2])
    extra = mx.full((1, 1, 5, 1), -1.0)
    for c in cache:  # what the batch does: write past the match
        c.update_and_fetch(extra, extra)
    mx.eval([c.state for c in cache])
    again, _ = pc.lookup(a + [3])
    assert held(again) == a and held(cache) == a[:40] + [-1] * 5


def test_lru_eviction_by_bytes():
    one = sum(c.nbytes for c in kv(seq(0, 32)))
    pc = PrefixCache(int(one * 2.5), min_match=16)
    a, b, c = seq(1000, 32), seq(2000, 32), seq(3000, 32)
    pc.store(a, kv(a))
    pc.store(b, kv(b))
    assert pc.lookup(a + [0]) is not None  # a is now the most recently used
    pc.store(c, kv(c))
    assert pc.lookup(b + [0]) is None  # b, the least recently used, made room
    assert pc.lookup(a + [0]) is not None and pc.lookup(c + [0]) is not None
    stats = pc.stats()
    assert stats["entries"] == 2 and stats["bytes"] == 2 * one <= stats["max_bytes"] and stats["evictions"] == 1
    assert not pc.store(seq(0, 600), kv(seq(0, 600)))  # larger than the whole cache (KVCache grows by 256)


def test_an_entry_replaces_its_own_prefixes_and_covered_ones_are_not_kept():
    pc = PrefixCache(64 * MIB, min_match=16)
    a = seq(100, 80)
    assert pc.store(a[:40], kv(a[:40]))
    assert pc.store(a, kv(a))
    assert len(pc) == 1  # a[:40] was a prefix of a: a serves every lookup it served
    assert not pc.store(a[:60], kv(a[:60]))
    assert len(pc) == 1 and pc.lookup(a[:60] + [1])[1] == 60


def test_inconsistent_or_unsupported_caches_are_refused():
    pc = PrefixCache(64 * MIB, min_match=16)
    a = seq(100, 40)
    assert not pc.store(a, kv(a[:39]))  # tokens and cache disagree
    rotating = [RotatingKVCache(max_size=16) for _ in range(2)]
    assert unsupported_reason(rotating) is not None and "RotatingKVCache" in unsupported_reason(rotating)
    assert "ArraysCache" in unsupported_reason([KVCache(), ArraysCache(2)])
    assert unsupported_reason([KVCache(), KVCache()]) is None
    off = PrefixCache(64 * MIB, disabled_reason=unsupported_reason(rotating))
    assert not off.store(a, kv(a)) and off.lookup(a + [1]) is None
    assert off.stats()["enabled"] is False and "RotatingKVCache" in off.stats()["disabled_reason"]
    assert PrefixCache(0).stats()["enabled"] is False


def test_stats_count_lookups_hits_and_reused_tokens():
    pc = PrefixCache(64 * MIB, min_match=16)
    a = seq(100, 64)
    pc.store(a, kv(a))
    pc.lookup(a[:48] + seq(900, 52))  # 100 tokens, 48 reused
    pc.lookup(seq(5000, 50))  # a miss
    stats = pc.stats()
    assert (stats["lookups"], stats["hits"], stats["prompt_tokens"], stats["reused_tokens"]) == (2, 1, 150, 48)
    assert stats["hit_rate"] == pytest.approx(48 / 150)
    assert stats["entries"] == 1 and stats["bytes"] == sum(c.nbytes for c in kv(a))


def test_speculative_stores_are_sampled_while_nothing_hits_and_resume_on_a_hit():
    pc = PrefixCache(256 * MIB, min_match=16)
    for i in range(SPECULATIVE_PROBATION):  # prompts that share nothing: every one kept at first
        assert pc.store(seq(10_000 * (i + 1), 32), kv(seq(10_000 * (i + 1), 32)), speculative=True)
    offered = [seq(10_000 * (i + SPECULATIVE_PROBATION + 1), 32) for i in range(2 * SPECULATIVE_SAMPLE)]
    kept = [pc.store(tokens, kv(tokens), speculative=True) for tokens in offered]
    assert sum(kept) == 2 and pc.stats()["skipped_stores"] == 2 * SPECULATIVE_SAMPLE - 2
    shared = seq(7, 40)  # stored on purpose (a prefix being prefilled for sharing): never skipped
    assert pc.store(shared, kv(shared))
    assert pc.lookup(shared[:20] + [0]) is not None  # the cache serves again: keep everything
    fresh = seq(90_000_000, 32)
    assert pc.store(fresh, kv(fresh), speculative=True) and pc.lookup(fresh + [1]) is not None


def test_a_cache_that_keeps_being_hit_keeps_every_speculative_store():
    pc = PrefixCache(256 * MIB, min_match=16)
    system = seq(1, 32)
    for i in range(3 * SPECULATIVE_PROBATION):  # each conversation's follow-up hits the shared start
        turn = system + seq(10_000 * (i + 1), 16)
        pc.lookup(turn + [0])
        assert pc.store(turn, kv(turn), speculative=True)
    assert pc.stats()["skipped_stores"] == 0


def test_lookup_stays_cheap_with_many_long_entries():
    pc = PrefixCache(1 << 40, min_match=16)
    shared = seq(0, 1024)
    rng = random.Random(0)
    for i in range(64):
        tokens = shared + [rng.randrange(50_000) for _ in range(3072)]
        pc.store(tokens, kv(tokens, layers=1))
    prompt = shared + [rng.randrange(50_000) for _ in range(3072)]
    start = time.perf_counter()
    for _ in range(20):
        assert pc.lookup(prompt)[1] == 1024
    per_lookup = (time.perf_counter() - start) / 20
    assert per_lookup < 0.02, f"{per_lookup * 1000:.1f} ms per lookup of a 4096-token prompt over 64 entries"


# --- the text engine -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model_and_tokenizer(tiny_model_dir):
    return load(tiny_model_dir)


def engine(model_and_tokenizer, cache_mb: int) -> TextEngine:
    model, tokenizer = model_and_tokenizer
    return TextEngine(model, tokenizer, prefix_cache_bytes=cache_mb * MIB)


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(n)]


PREFIX = prompt(1, 150)


def compare(result, reference, logprob_tol: float = 1e-4) -> None:
    assert result.status == reference.status == "finished"
    assert len(result.choices) == len(reference.choices)
    for got, want in zip(result.choices, reference.choices):
        assert got.token_ids == want.token_ids
        if want.logprobs is not None:
            assert got.logprobs == pytest.approx(want.logprobs, abs=logprob_tol)


def second_request_reuses(model_and_tokenizer, first: dict, second: dict) -> tuple:
    """Run `first` then `second` on one engine with the cache on; `second` again on a fresh engine
    with it off. Returns (second's result with the cache, without, the cached engine's stats
    before and after `second`, the uncached engine's stats)."""
    cached = engine(model_and_tokenizer, 64)
    scheduler = BatchScheduler(cached)
    run_all(scheduler, {"first": first})
    before = cached.prefix_cache_stats()
    got = run_all(scheduler, {"second": second})["second"]
    after = cached.prefix_cache_stats()
    fresh = engine(model_and_tokenizer, 0)
    want = run_all(BatchScheduler(fresh), {"second": second})["second"]
    return got, want, before, after, fresh.prefix_cache_stats()


def test_greedy_request_sharing_a_prefix_matches_a_fresh_engine(model_and_tokenizer):
    base = {"max_tokens": 12, "temperature": 0, "logprobs": True, "top_logprobs": 3, "ignore_eos": True}
    first = {**base, "prompt_token_ids": PREFIX + prompt(2, 10)}
    second = {**base, "prompt_token_ids": PREFIX + prompt(3, 20)}
    got, want, before, after, off = second_request_reuses(model_and_tokenizer, first, second)
    compare(got, want)
    for g, w in zip(got.choices[0].top_logprobs, want.choices[0].top_logprobs):
        assert [t.token_id for t in g] == [t.token_id for t in w]
    assert after["reused_tokens"] - before["reused_tokens"] == len(PREFIX)
    assert after["hits"] == before["hits"] + 1
    assert off["enabled"] is False and off["reused_tokens"] == 0 and off["hits"] == 0


def test_penalties_see_the_whole_prompt_on_a_hit(model_and_tokenizer):
    # The penalised distribution itself is compared ("processed"): a token context that started
    # at the cached boundary instead of the prompt's first token would change it.
    base = {"max_tokens": 16, "temperature": 0, "logprobs": True, "logprobs_mode": "processed",
            "repetition_penalty": 1.5, "presence_penalty": 0.7, "frequency_penalty": 0.3, "ignore_eos": True}
    first = {**base, "prompt_token_ids": PREFIX + prompt(4, 5)}
    second = {**base, "prompt_token_ids": PREFIX + prompt(5, 7)}
    got, want, before, after, _ = second_request_reuses(model_and_tokenizer, first, second)
    compare(got, want)
    assert after["reused_tokens"] - before["reused_tokens"] == len(PREFIX)
    assert len(set(want.choices[0].token_ids)) > 1  # the penalty is doing something here


def test_seeded_n2_sampling_on_a_hit_matches_a_fresh_engine(model_and_tokenizer):
    base = {"max_tokens": 12, "temperature": 0.9, "top_p": 0.95, "seed": 1234, "n": 2, "logprobs": True,
            "ignore_eos": True}
    first = {**base, "prompt_token_ids": PREFIX + prompt(6, 9)}
    second = {**base, "prompt_token_ids": PREFIX + prompt(7, 11)}
    got, want, before, after, _ = second_request_reuses(model_and_tokenizer, first, second)
    compare(got, want)
    assert got.choices[0].token_ids != got.choices[1].token_ids
    assert after["reused_tokens"] - before["reused_tokens"] == len(PREFIX)


def test_a_follow_up_turn_reuses_the_finished_sequence_with_its_output(model_and_tokenizer):
    base = {"max_tokens": 10, "temperature": 0, "logprobs": True, "ignore_eos": True}
    first_prompt = PREFIX + prompt(8, 6)
    cached = engine(model_and_tokenizer, 64)
    scheduler = BatchScheduler(cached)
    first = run_all(scheduler, {"first": {**base, "prompt_token_ids": first_prompt}})["first"]
    follow_up = {**base, "prompt_token_ids": first_prompt + first.choices[0].token_ids + prompt(9, 8)}
    got = run_all(scheduler, {"second": follow_up})["second"]
    want = run_all(BatchScheduler(engine(model_and_tokenizer, 0)), {"second": follow_up})["second"]
    compare(got, want)
    # Every token of the first sequence was cached: its prompt and its output.
    assert cached.prefix_cache_stats()["reused_tokens"] == len(first_prompt) + len(first.choices[0].token_ids)


def test_prompts_arriving_together_prefill_their_shared_prefix_once(model_and_tokenizer):
    base = {"max_tokens": 8, "temperature": 0, "logprobs": True, "ignore_eos": True}
    requests = {f"r{i}": {**base, "prompt_token_ids": PREFIX + prompt(10 + i, 5 + i)} for i in range(4)}
    cached = engine(model_and_tokenizer, 64)
    got = run_all(BatchScheduler(cached), requests)
    want = run_all(BatchScheduler(engine(model_and_tokenizer, 0)), requests)
    for job_id in requests:
        compare(got[job_id], want[job_id])
    stats = cached.prefix_cache_stats()
    assert stats["lookups"] == 4 and stats["reused_tokens"] == 3 * len(PREFIX)  # the first one computed it


def test_the_n_choices_prefill_is_kept_for_the_next_request(model_and_tokenizer):
    base = {"max_tokens": 6, "temperature": 0, "logprobs": True, "ignore_eos": True}
    p = PREFIX + prompt(20, 4)
    cached = engine(model_and_tokenizer, 64)
    scheduler = BatchScheduler(cached)
    assert scheduler.admit("n2", {**base, "prompt_token_ids": p, "n": 2}) is None
    scheduler.step()  # the shared prefill happens here
    assert cached.prefix_cache_stats()["entries"] == 1
    while len(scheduler):
        scheduler.step()
    got = run_all(scheduler, {"again": {**base, "prompt_token_ids": p}})["again"]
    want = run_all(BatchScheduler(engine(model_and_tokenizer, 0)), {"again": {**base, "prompt_token_ids": p}})["again"]
    compare(got, want)
    assert cached.prefix_cache_stats()["reused_tokens"] == len(p) - 1


def test_a_model_with_a_sliding_window_cache_keeps_the_cache_empty(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer

    class SlidingWindow:  # the tiny model, but with the cache a sliding-window model makes
        def __init__(self, inner):
            self.inner, self.layers, self.args = inner, inner.layers, inner.args

        def __call__(self, *args, **kwargs):
            return self.inner(*args, **kwargs)

        def make_cache(self):
            return [RotatingKVCache(max_size=512) for _ in self.layers]

    sliding = TextEngine(SlidingWindow(model), tokenizer, prefix_cache_bytes=64 * MIB)
    scheduler = BatchScheduler(sliding)
    base = {"max_tokens": 4, "temperature": 0, "ignore_eos": True}
    results = run_all(scheduler, {f"r{i}": {**base, "prompt_token_ids": PREFIX + prompt(30 + i, 3)} for i in range(2)})
    assert all(r.status == "finished" for r in results.values())
    stats = sliding.prefix_cache_stats()
    assert stats["enabled"] is False and "RotatingKVCache" in stats["disabled_reason"]
    assert stats["entries"] == 0 and stats["reused_tokens"] == 0


def test_the_fake_engine_reports_the_same_fields(model_and_tokenizer):
    assert FakeEngine().prefix_cache_stats().keys() == engine(model_and_tokenizer, 1).prefix_cache_stats().keys()


def test_the_setting_reaches_the_engine(tiny_model_dir):
    from mlxq.cli import build_parser
    from worker.loading import build_engine
    from worker.settings import WorkerSettings

    assert WorkerSettings.from_env({}).prefix_cache_mb == 1024
    assert WorkerSettings.from_env({"MLXQ_PREFIX_CACHE_MB": "0"}).prefix_cache_bytes == 0
    with pytest.raises(ValueError, match="MLXQ_PREFIX_CACHE_MB"):
        WorkerSettings.from_env({"MLXQ_PREFIX_CACHE_MB": "-1"})
    assert build_parser().parse_args(["worker", "--prefix-cache-mb", "0"]).prefix_cache_mb == 0
    on = build_engine(WorkerSettings.from_env({}, model=tiny_model_dir)).prefix_cache_stats()
    assert on["enabled"] is True and on["max_bytes"] == 1024 * MIB
    off = build_engine(WorkerSettings.from_env({"MLXQ_PREFIX_CACHE_MB": "0"}, model=tiny_model_dir))
    assert off.prefix_cache_stats()["enabled"] is False


@pytest.mark.slow
def test_the_worker_publishes_its_prefix_cache_counters(redis_url, tiny_model_dir):
    import redis

    from producer import Client
    from schemas import keys
    from tests.workers import start_worker, stop

    system = [(7 * k) % 400 + 5 for k in range(48)]
    proc = start_worker(redis_url, tiny_model_dir, name="stats-pub")
    client = Client(redis_url)
    try:
        for tail in ([11, 12], [13, 14]):  # one after the other: the second finds the first's cache
            job_id = client.submit({"prompt_token_ids": system + tail, "max_tokens": 3, "temperature": 0})
            assert client.wait(job_id, timeout=120).status == "finished"
        stats = {k.decode(): v.decode() for k, v in redis.Redis.from_url(redis_url).hgetall(
            keys.stats_key("stats-pub")).items()}
    finally:
        stop(proc)
    assert stats["prefix_cache_enabled"] == "True"
    assert int(stats["prefix_cache_lookups"]) >= 2 and int(stats["prefix_cache_hits"]) >= 1
    assert int(stats["prefix_cache_reused_tokens"]) >= len(system)


class CountingModel:
    """The model, counting the tokens run through it (prefill and decode)."""

    def __init__(self, model) -> None:
        self.model = model
        self.tokens = 0

    def __call__(self, inputs, *args, **kwargs):
        self.tokens += inputs.size
        return self.model(inputs, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.model, name)


@pytest.mark.parametrize("cache_mb, shared", [(64, True), (0, False)])
def test_identical_prompts_of_different_requests_share_a_prefill_only_with_the_cache_on(
        model_and_tokenizer, cache_mb, shared):
    model, tokenizer = model_and_tokenizer
    counting = CountingModel(model)
    text = TextEngine(counting, tokenizer, prefix_cache_bytes=cache_mb * MIB)
    body = {"prompt_token_ids": PREFIX, "max_tokens": 2, "temperature": 0, "ignore_eos": True}
    results = run_all(BatchScheduler(text), {f"r{i}": body for i in range(4)})
    assert len({tuple(r.choices[0].token_ids) for r in results.values()}) == 1
    counting.tokens -= 1  # the KV-size probe at construction ran one token
    prompt_runs = (counting.tokens - 4 * 2) / len(PREFIX)  # less each request's decode tokens (at most 2)
    assert prompt_runs < 1.5 if shared else prompt_runs >= 4
