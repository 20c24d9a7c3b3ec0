"""The trainer's side in MLX: the policy it trains, the weight versions it keeps, the logprobs it
recomputes, and one GRPO update.

Two recomputations of a sample's logprobs, for two purposes:
- `replay_logprobs`: the distribution that sampled each token, as the worker computed it. A sample
  of one version is one teacher-forced pass under it; one whose tokens came from several
  (`Choice.weight_versions`, the `inflight` policy) is run through a KV cache segment by segment,
  each under the version that sampled its tokens: the keys and values of the positions before a
  swap were written by the old weights, so a plain teacher-forced pass under the new version is
  not the distribution that sampled the later tokens.
- `sequence_logprobs`: the current parameters' logprobs of every sample, one batched
  teacher-forced pass, differentiable: the policy-gradient loss is built on it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx.utils import tree_flatten, tree_unflatten

Params = dict[str, mx.array]  # flat, in MLX's naming: what a published version holds


@dataclass
class Sample:
    """One choice of a rollout, as the worker returned it, and what the trainer makes of it."""

    group: int  # the prompt it was sampled for (GRPO normalises rewards within a group)
    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]  # returned by the worker (logprobs_mode "raw", temperature 1.0)
    segments: list[tuple[int, int]]  # (first token index, weight version) of each stretch of tokens
    reward: float = 0.0
    advantage: float = 0.0


class VersionStore:
    """The parameters of every version a result may still record: the trainer snapshots each
    version it publishes and forgets those below the lowest `min_weight_version` still asked for."""

    def __init__(self) -> None:
        self._params: dict[int, Params] = {}

    def keep(self, version: int, params: Params) -> None:
        self._params[version] = params  # MLX arrays are immutable: a snapshot, not a view

    def __contains__(self, version: int) -> bool:
        return version in self._params

    def get(self, version: int) -> Params:
        return self._params[version]

    def forget_below(self, version: int) -> None:
        for old in [v for v in self._params if v < version]:
            del self._params[old]

    @property
    def versions(self) -> list[int]:
        return sorted(self._params)


def flat_parameters(model: nn.Module) -> Params:
    return dict(tree_flatten(model.parameters()))


def load_params(model: nn.Module, params: Params) -> None:
    model.update(tree_unflatten(list(params.items())))


def save_version(params: Params, directory: Path) -> Path:
    """A version as the workers read it: every parameter, MLX's names, one safetensors file."""
    directory.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(directory / "model.safetensors"), params, metadata={"format": "mlx"})
    return directory


def replay_logprobs(model: nn.Module, versions: VersionStore, samples: list[Sample]) -> list[list[float]]:
    """The logprob of each sampled token under the distribution that sampled it (see the module
    docstring), float32, raw log-softmax. A sample of one version is one teacher-forced pass,
    batched with the others of that version; a sample of several goes through a KV cache segment
    by segment, `model` loaded with each segment's version in turn."""
    out: list[list[float]] = [[] for _ in samples]
    single: dict[int, list[int]] = {}
    for i, sample in enumerate(samples):
        if len({v for _, v in sample.segments}) == 1:
            single.setdefault(sample.segments[0][1], []).append(i)
        else:
            out[i] = _replay_segments(model, versions, sample)
    for version, indexes in single.items():
        load_params(model, versions.get(version))
        batch = PaddedBatch.of([samples[i] for i in indexes])
        logprobs = sequence_logprobs(model, batch).tolist()
        for row, i in enumerate(indexes):
            first = len(samples[i].prompt_ids) - 1
            out[i] = logprobs[row][first:first + len(samples[i].token_ids)]
    return out


def _replay_segments(model: nn.Module, versions: VersionStore, sample: Sample) -> list[float]:
    from mlx_lm.models.cache import make_prompt_cache

    prompt, tokens = sample.prompt_ids, sample.token_ids
    inputs = prompt + tokens[:-1]  # position p's logits sample token p - len(prompt) + 1
    cache = make_prompt_cache(model)
    ends = [start for start, _ in sample.segments[1:]] + [len(tokens)]
    done, out = 0, []
    for (start, version), end in zip(sample.segments, ends):
        if end <= start:
            continue
        load_params(model, versions.get(version))
        upto = len(prompt) - 1 + end
        logits = model(mx.array(inputs[done:upto])[None], cache=cache)[0].astype(mx.float32)
        rows = logits[len(prompt) - 1 + start - done:]
        logprobs = rows - mx.logsumexp(rows, axis=-1, keepdims=True)
        out += mx.take_along_axis(logprobs, mx.array(tokens[start:end])[:, None], axis=-1)[:, 0].tolist()
        done = upto
    return out


@dataclass
class PaddedBatch:
    """Samples right-padded into arrays: inputs, the token each position predicts, which positions
    are sampled tokens, the worker's logprobs there, and each sample's advantage."""

    inputs: mx.array  # (B, L) int32
    targets: mx.array  # (B, L) int32
    mask: mx.array  # (B, L) float32: 1 where the target is a sampled token
    behaviour: mx.array  # (B, L) float32: the worker's logprob of that token
    advantages: mx.array  # (B,) float32

    @classmethod
    def of(cls, samples: list[Sample]) -> "PaddedBatch":
        width = max(len(s.prompt_ids) + len(s.token_ids) - 1 for s in samples)
        inputs, targets, mask, behaviour = [], [], [], []
        for s in samples:
            stream = s.prompt_ids + s.token_ids
            pad = width - (len(stream) - 1)
            first = len(s.prompt_ids) - 1  # the position whose logits sampled the first token
            inputs.append(stream[:-1] + [0] * pad)
            targets.append(stream[1:] + [0] * pad)
            mask.append([0.0] * first + [1.0] * len(s.token_ids) + [0.0] * pad)
            behaviour.append([0.0] * first + list(s.logprobs) + [0.0] * pad)
        return cls(mx.array(inputs), mx.array(targets), mx.array(mask), mx.array(behaviour),
                   mx.array([s.advantage for s in samples], dtype=mx.float32))


def sequence_logprobs(model: nn.Module, batch: PaddedBatch) -> mx.array:
    """(B, L) logprob of each target token under the model's current parameters (teacher forcing)."""
    logits = model(batch.inputs).astype(mx.float32)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    return mx.take_along_axis(logprobs, batch.targets[..., None], axis=-1)[..., 0]


def grpo_loss(model: nn.Module, batch: PaddedBatch, clip: float) -> mx.array:
    """GRPO's clipped surrogate, without a KL term: per token, the importance ratio of the current
    policy to the one that sampled (the worker's logprobs) times the sample's advantage, clipped as
    in PPO; averaged over each sample's tokens, then over samples."""
    ratio = mx.exp(sequence_logprobs(model, batch) - batch.behaviour)
    advantage = batch.advantages[:, None]
    surrogate = mx.minimum(ratio * advantage, mx.clip(ratio, 1 - clip, 1 + clip) * advantage)
    per_sample = (surrogate * batch.mask).sum(axis=1) / mx.maximum(batch.mask.sum(axis=1), 1.0)
    return -per_sample.mean()


class Trainer:
    """The policy (the model the trainer holds), its optimizer, and the versions it published."""

    def __init__(self, model_path: str, learning_rate: float, clip: float) -> None:
        from mlx_lm import load

        self.model, _ = load(model_path)
        self.replay_model, _ = load(model_path)  # loaded with old versions to check results
        self.optimizer = optim.Adam(learning_rate=learning_rate)
        self.clip = clip
        self.versions = VersionStore()
        self.versions.keep(0, flat_parameters(self.model))  # the weights the workers started with
        self._loss_and_grad = nn.value_and_grad(self.model, lambda m, b: grpo_loss(m, b, self.clip))

    def update(self, samples: list[Sample]) -> float:
        """One optimizer step on the samples; returns the loss before it."""
        loss, grads = self._loss_and_grad(self.model, PaddedBatch.of(samples))
        self.optimizer.update(self.model, grads)
        mx.eval(self.model.parameters(), self.optimizer.state, loss)
        return float(loss.item())

    def snapshot(self, version: int) -> Params:
        params = flat_parameters(self.model)
        self.versions.keep(version, params)
        return params

    def replay(self, samples: list[Sample]) -> list[list[float]]:
        return replay_logprobs(self.replay_model, self.versions, samples)
