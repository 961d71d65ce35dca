"""TRL's ``GRPOTrainer`` on per-token advantages: HCAPO's credits, or any (B, T) you compute.

    from trl import GRPOConfig
    from hcapo_store.training.trl_grpo import HCAPOGRPOTrainer, StoreAdvantages

    source = StoreAdvantages(store, tokenizer=MODEL_DIR, workdir="rollouts/")
    trainer = HCAPOGRPOTrainer(model=MODEL_DIR, reward_funcs=reward, args=GRPOConfig(...),
                               train_dataset=prompts, advantages=source)
    trainer.train()

TRL generates and rewards the completions as usual; then, instead of one group-normalised
advantage per completion (B,), the trainer asks ``advantages`` for one float per completion
token and trains on that (B, T) tensor. TRL's loss takes (B, T) advantages as they are (it
unsqueezes only a (B,) one); upstream does not plan per-token advantages (trl #7182/#7331), so
this subclass overrides ``_generate_and_score_completions`` as TRL's maintainers advise (trl
#4525) and ``_calculate_rewards`` to see each batch's completions and rewards. Both are private:
``TRL_VERSIONS`` is the range tested, ``check_trl()`` refuses another TRL loudly, and
tests/test_trl_grpo.py holds their signatures and the keys of the returned dict against the
installed TRL.

``advantages`` is a callable ``(RolloutBatch) -> one sequence of floats per row, one per
completion token``. ``StoreAdvantages`` is HCAPO's: it adds the batch's rollouts to the store,
scores them with the policy itself at weight version ``step-N`` (``score_live``), computes the
batch's credits (GRPO groups as ``group_by`` groups) and places them on the rollouts' own ids
with a ``Handoff``. Whatever the source, values land only on completion tokens the loss trains
(``completion_mask`` × ``tool_mask``), and a NaN or inf is refused with the row and position.
"""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import trl
from trl import GRPOTrainer

from hcapo_store.credits.log_ratio import LogRatioParams
from hcapo_store.credits.params import CreditParams
from hcapo_store.credits.signal import CreditSignal
from hcapo_store.errors import HandoffError
from hcapo_store.rendering.tokenizers import KeptTokenizer
from hcapo_store.storage.store import Store
from hcapo_store.training.handoff import with_lead_in

# The TRL releases whose private methods this subclass was checked against (pyproject pins the same).
TRL_VERSIONS = ((1, 16), (1, 17))  # [low, high) as (major, minor)
GROUP_TAG = "group"  # the ingest tag naming a rollout's GRPO group (CreditParams.group_by)


def check_trl(version: str | None = None) -> None:
    """Refuses a TRL outside ``TRL_VERSIONS``: the overridden methods may have changed."""
    text = version or trl.__version__
    match = re.match(r"(\d+)\.(\d+)", text)
    low, high = TRL_VERSIONS
    if match is None or not low <= (int(match[1]), int(match[2])) < high:
        pin = f"trl>={low[0]}.{low[1]},<{high[0]}.{high[1]}"
        raise RuntimeError(
            f"hcapo_store.training.trl_grpo supports {pin} (it overrides GRPOTrainer's private "
            f"_generate_and_score_completions and _calculate_rewards); trl {text} is installed: pip install '{pin}'"
        )


@dataclass
class RolloutBatch:
    """One generation batch as TRL produced and rewarded it (this process's rows)."""

    step: int  # trainer.state.global_step when it was generated
    prompts: list[Any]  # TRL's prompts: message lists (conversational) or text
    completions: list[Any]  # TRL's decoded completions: message lists or text
    prompt_ids: list[list[int]]  # unpadded
    completion_ids: list[list[int]]  # unpadded, as the policy generated them
    loss_mask: list[list[int]]  # per completion token: 1 where the loss trains it (not a tool result, not masked)
    rewards: list[float]  # the weighted sum of the reward functions; NaN when none scored the row
    groups: list[int]  # rows with one group index share a prompt (GRPO's num_generations)
    trl_advantages: list[float]  # TRL's own advantage of each row (group-normalised reward), for reference
    inputs: list[dict[str, Any]] = field(repr=False)  # the dataset rows
    model: Any = field(default=None, repr=False)  # the policy that generated them (unwrapped)
    processes: int = 1  # training processes: each holds its own rows of the generation batch
    mode: str = "train"  # "eval" for an evaluation pass's rollouts (same step as a training batch)
    tools: int = 0  # TRL's tools= (how many): their definitions are not in the store's prompts

    def as_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "rows": len(self.completion_ids),
            "prompt_ids": self.prompt_ids,
            "completion_ids": self.completion_ids,
            "loss_mask": self.loss_mask,
            "rewards": self.rewards,
            "groups": self.groups,
            "trl_advantages": self.trl_advantages,
            "processes": self.processes,
            "mode": self.mode,
            "tools": self.tools,
        }


AdvantageSource = Callable[[RolloutBatch], Sequence[Sequence[float]]]


def trl_advantages(batch: RolloutBatch) -> list[list[float]]:
    """TRL's own advantage of each row on every completion token: plain GRPO, as a source (the
    yardstick the tests and the benchmark hold this trainer to)."""
    return [[a] * len(ids) for a, ids in zip(batch.trl_advantages, batch.completion_ids)]


def place(batch: RolloutBatch, values: Sequence[Sequence[float]], width: int) -> torch.Tensor:
    """(B, width) float32: row i's values on its completion tokens the loss trains, 0 elsewhere
    (padding, tool results, masked completions). Refuses a wrong length, NaN or inf."""
    if len(values) != len(batch.completion_ids):
        raise HandoffError(f"the advantage source gave {len(values)} rows for a batch of {len(batch.completion_ids)}")
    out = np.zeros((len(values), width), dtype=np.float32)
    for i, (row, ids, mask) in enumerate(zip(values, batch.completion_ids, batch.loss_mask)):
        adv = np.asarray(row, dtype=np.float64)
        if adv.shape != (len(ids),):
            raise HandoffError(
                f"row {i} (group {batch.groups[i]}): the advantage source gave {adv.shape} values "
                f"for {len(ids)} completion tokens"
            )
        with np.errstate(over="ignore", invalid="ignore"):
            cast = adv.astype(np.float32)  # checked after the cast: 1e39 is finite in float64, inf here
        bad = ~np.isfinite(cast)
        if bad.any():
            at = int(np.flatnonzero(bad)[0])
            beyond = " (beyond float32's range)" if np.isfinite(adv[at]) else ""
            raise HandoffError(
                f"step {batch.step}, row {i} (group {batch.groups[i]}): advantage {float(adv[at])!r}{beyond} at completion "
                f"token {at}: a NaN or inf never reaches the trainer"
            )
        out[i, : len(ids)] = cast * np.asarray(mask, dtype=np.float32)
    return torch.from_numpy(out)


class HCAPOGRPOTrainer(GRPOTrainer):
    """``GRPOTrainer`` that trains on per-token advantages from ``advantages`` (a callable
    ``RolloutBatch -> per-row floats per completion token``, e.g. ``StoreAdvantages``)."""

    def __init__(self, *args: Any, advantages: AdvantageSource, **kwargs: Any) -> None:
        check_trl()
        if not callable(advantages):
            raise TypeError(
                "advantages= must be a callable RolloutBatch -> per-token advantages (e.g. StoreAdvantages)"
            )
        self.advantage_source = advantages
        self._rollouts: tuple[list[Any], list[Any], list[list[int]], torch.Tensor] | None = None
        self.last_batch: RolloutBatch | None = None  # the batch the last advantages were placed on
        super().__init__(*args, **kwargs)

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        # the one place TRL hands over prompts, completions and unpadded ids together: keep them
        rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        self._rollouts = (
            list(prompts),
            list(completions),
            [list(map(int, c)) for c in completion_ids_list],
            rewards_per_func,
        )
        return rewards_per_func

    def _generate_and_score_completions(self, inputs):
        self._rollouts = None
        output = super()._generate_and_score_completions(inputs)
        if self._rollouts is None:
            raise RuntimeError("TRL did not call _calculate_rewards: this TRL is not one hcapo-store supports")
        prompts, completions, completion_ids, rewards_per_func = self._rollouts
        self._rollouts = None
        n = len(completion_ids)
        local = slice(self.accelerator.process_index * n, (self.accelerator.process_index + 1) * n)
        weighted = (rewards_per_func * self.reward_weights.to(rewards_per_func.device).unsqueeze(0)).nansum(dim=1)
        weighted[torch.isnan(rewards_per_func).all(dim=1)] = torch.nan  # as TRL: no function scored it
        prompt_mask = output["prompt_mask"].bool().cpu()
        loss_mask = output["completion_mask"]
        if "tool_mask" in output:
            loss_mask = loss_mask * output["tool_mask"]
        loss_mask = loss_mask.cpu()
        mode = "train" if self.model.training else "eval"
        num_generations = self.num_generations if mode == "train" else self.num_generations_eval
        first = self.accelerator.process_index * n
        batch = RolloutBatch(
            step=int(self.state.global_step),
            prompts=prompts,
            completions=completions,
            prompt_ids=[row[m].tolist() for row, m in zip(output["prompt_ids"].cpu(), prompt_mask)],
            completion_ids=completion_ids,
            loss_mask=[loss_mask[i, : len(ids)].tolist() for i, ids in enumerate(completion_ids)],
            rewards=[float(r) for r in weighted[local].tolist()],
            groups=[(first + i) // num_generations for i in range(n)],
            trl_advantages=[float(a) for a in output["advantages"].reshape(-1).tolist()],
            inputs=list(inputs),
            model=self.accelerator.unwrap_model(self.model),
            processes=int(self.accelerator.num_processes),
            mode=mode,
            tools=len(getattr(self, "tools", None) or []),
        )
        started = time.perf_counter()
        values = self.advantage_source(batch)
        advantages = place(batch, values, output["completion_ids"].size(1))
        self._metrics[mode]["hcapo/advantages_seconds"].append(time.perf_counter() - started)
        output["advantages"] = advantages.to(output["completion_ids"].device)
        self.last_batch = batch
        source = self.advantage_source
        # this batch's own (StoreAdvantages.last_signal); a wrapper that passes on only ``signals``: its step's
        signal = (
            source.last_signal if hasattr(source, "last_signal") else getattr(source, "signals", {}).get(batch.step)
        )
        for key, rows in (("hcapo/skipped_rows", "last_skipped"), ("hcapo/refused_rows", "last_refused")):
            if hasattr(source, rows):  # rows left at 0 (or partly), said in the logs, never silent
                self._metrics[mode][key].append(float(len(getattr(source, rows))))
        if signal is not None:  # StoreAdvantages: whether HCAPO's hindsight term is in this batch
            self._metrics[mode]["hcapo/hindsight_nonzero_share"].append(signal.hindsight_share)
            self._metrics[mode]["hcapo/advantage_spread"].append(signal.advantage_spread)
        trained = loss_mask.bool()
        if trained.any():
            self._metrics[mode]["hcapo/advantage_mean"].append(float(advantages[trained].mean()))
            self._metrics[mode]["hcapo/advantage_abs_max"].append(float(advantages[trained].abs().max()))
        return output


class HandoffAdvantages:
    """Per-token advantages of rollouts already in the store (e.g. written by an agent loop and
    credited by ``follow``): ``handoff`` (a ``Handoff``, or ``RolloutBatch -> Handoff``) places
    each row's credit run advantages on the row's own prompt + completion ids, found as episode
    ``episode_of(batch, row)``; the completion part is returned. ``strict`` as in ``Handoff``:
    a step whose own tokens are not in the rollout's ids, or an action token the loss does not
    train, raises a ``HandoffError`` naming the row, episode and step; ``strict=False`` leaves
    that step at 0 and lists it in ``refused``. A trained row whose completion holds no step of
    the episode (an ended completion with no text) gets 0 and is listed in ``skipped``.
    ``refused`` and ``skipped`` are keyed ``(step, row)`` and hold training batches' rows (a
    further training batch at a step replaces that step's); ``last_refused`` and
    ``last_skipped``, keyed by row, the last batch's of any mode (an evaluation pass's too)."""

    def __init__(
        self,
        handoff: Any,
        episode_of: Callable[[RolloutBatch, int], str | int],
        *,
        strict: bool = True,
    ) -> None:
        self.handoff = handoff
        self.episode_of = episode_of
        self.strict = strict
        self.refused: dict[tuple[int, int], dict[int, str]] = {}  # (step, row) -> {step_index: why}
        self.skipped: dict[tuple[int, int], str] = {}  # (step, row) -> why it got no advantage
        self.last_refused: dict[int, dict[int, str]] = {}  # row -> {step_index: why}, the last batch's
        self.last_skipped: dict[int, str] = {}  # row -> why, the last batch's

    def _begin(self, batch: RolloutBatch) -> None:
        """A new batch's records: the last batch's start empty; a training batch replaces its
        step's (an evaluation pass at the same step keeps out of them)."""
        self.last_refused, self.last_skipped = {}, {}
        if batch.mode == "train":
            for records in (self.refused, self.skipped):
                for key in [k for k in records if k[0] == batch.step]:
                    del records[key]

    def _skip(self, batch: RolloutBatch, row: int, why: str) -> None:
        self.last_skipped[row] = why
        if batch.mode == "train":
            self.skipped[(batch.step, row)] = why

    def _refuse(self, batch: RolloutBatch, row: int, step: int, why: str) -> None:
        self.last_refused.setdefault(row, {})[step] = why
        if batch.mode == "train":
            self.refused.setdefault((batch.step, row), {})[step] = why

    def __call__(self, batch: RolloutBatch) -> list[np.ndarray]:
        from hcapo_store.training.handoff import Handoff

        self._begin(batch)
        handoff = self.handoff if isinstance(self.handoff, Handoff) else self.handoff(batch)
        out = [np.zeros(len(ids), dtype=np.float64) for ids in batch.completion_ids]
        for i in range(len(out)):
            if any(batch.loss_mask[i]):  # nothing of a row is trained otherwise (a masked truncated completion)
                out[i] = self.row(handoff, batch, i, self.episode_of(batch, i))
        return out

    def row(self, handoff: Any, batch: RolloutBatch, i: int, episode: str | int) -> np.ndarray:
        """Row ``i``'s advantages on its completion tokens the loss trains."""
        prompt, completion = batch.prompt_ids[i], batch.completion_ids[i]
        start = len(prompt)
        try:
            credit = handoff.advantages(episode, [*prompt, *completion], strict=self.strict)
        except HandoffError as exc:
            ends = {handoff.tokenizer.eos_token_id, handoff.tokenizer.pad_token_id}
            cut = not completion or completion[-1] not in ends
            hint = " (its completion was cut at max_completion_length: mask_truncated_completions=True leaves such rows out)"
            raise HandoffError(f"step {batch.step}, row {i}: {exc}{hint if cut else ''}") from exc
        for index, why in credit.refused.items():
            self._refuse(batch, i, index, why)
        trained = np.asarray(batch.loss_mask[i], dtype=bool)
        if trained.any() and not credit.mask[start:].any() and not credit.refused:
            # nothing of the completion is a stored step's (an ended completion with no text, say):
            # its 0 is said, not silent
            self._skip(
                batch,
                i,
                "its completion holds no step of the stored episode (no text the store keeps as a step): "
                "no advantage to place, 0",
            )
        untrained = credit.mask[start:] & ~trained
        if untrained.any():
            at = int(np.flatnonzero(untrained)[0])
            step = next((k for k, (a, b) in credit.spans.items() if a <= start + at < b), None)
            why = f"step {step}'s token at completion position {at} is an action token the loss does not train"
            if self.strict:
                raise HandoffError(f"step {batch.step}, row {i}, episode {episode}: {why}")
            self._refuse(batch, i, int(step if step is not None else -1), why)
        # the policy's own wrapper before a step (Qwen3's empty think block with thinking on) is trained:
        # it carries the step's advantage, as every completion token does in GRPO
        return with_lead_in(credit, trained, start) * trained


class StoreAdvantages(HandoffAdvantages):
    """HCAPO's per-token advantages for a GRPO batch, from the store.

    Per batch: each group's rollouts are written as a JSONL file under ``workdir`` (prompt
    messages + the completion's messages, TRL's reward) and ingested with the tag
    ``group=step-N/gK`` (files and episode ids carry ``RUN``: ``run_id``, default a random one;
    an evaluation pass's batch is ``step-N-eval``, a further batch at the same step ``.K`` after
    it: every batch's groups hold its own rollouts only);
    the policy that generated them scores them in process at weight version ``RUN/step-N``
    (``score_live``); the batch's credits are computed over exactly those episodes
    (``params``, default the paper's estimator per GRPO group); and a ``Handoff`` places
    each step's advantage on the rollout's own prompt + completion ids, of which the completion
    part is returned. A row the loss does not train (a masked truncated completion) is stored
    but not looked up; a row no reward function scored is left out (0, listed in ``skipped``), and
    so is a trained row whose completion holds no step of its episode (an ended completion with no
    text): its 0 is listed, never silent.

    ``strict`` (default): a step whose own tokens are not in the rollout's ids, or an action
    token the loss does not train, raises a ``HandoffError`` naming the row, episode and step;
    ``strict=False`` leaves that step at 0 and lists it in ``refused``.

    ``variant="log-ratio"``: the batch's run is a log-ratio run instead (credits/log_ratio.py,
    docs/FAMILY.md): the policy scores the rollouts twice with ``action_span="policy"`` (the
    completion's own tokens), as the teacher (with the hindsight block) and as the student
    ``against="no-hindsight"`` (the same prompts without it), and each completion token gets
    ``A_i + kl_coef · g_t · (log π_teacher − log π_student)``. ``log_ratio``: its options
    (``LogRatioParams``, whose defaults are the library's), default ``LogRatioParams(grpo=True,
    group_by="group")``: the GRPO group's advantage stays the backbone, the log-ratio the dense term.

    ``signals[step]``: the step's training batch's hindsight signal (the share of steps whose
    hindsight term is non-zero, the spread of advantages within an episode); ``last_signal``: the
    last batch's, of any mode, which the trainer logs. ``runs``, ``scorers`` and ``episodes`` are
    per step as well, of its training batch (an evaluation batch's stay out of them). A batch whose
    hindsight term is zero on every step while its advantages are not is refused with a
    ``HandoffError`` unless ``allow_zero_hindsight=True`` (plain GRPO on purpose).

    The tokenizer is loaded once and kept (``kept_tokenizer``: loaded again only when its
    directory's files change): each step's ``score_live`` calls and ``Handoff`` take that one
    object, which none of them changes (it is not TRL's ``processing_class``).
    """

    def __init__(
        self,
        store: Store,
        *,
        tokenizer: str | Path,
        workdir: str | Path,
        params: CreditParams | None = None,
        strict: bool = True,
        run_id: str | None = None,
        allow_zero_hindsight: bool = False,
        variant: str | None = None,
        against: str | None = None,
        log_ratio: LogRatioParams | None = None,
        allow_mixed: bool = False,
    ) -> None:
        import uuid

        from hcapo_store.credits.log_ratio import NO_HINDSIGHT, VARIANT

        if variant not in (None, VARIANT):
            raise ValueError(f"variant must be None (HCAPO's run, by params=) or {VARIANT!r}, not {variant!r}")
        if variant == VARIANT:
            if against != NO_HINDSIGHT:
                raise ValueError(
                    f"variant='log-ratio' needs against='{NO_HINDSIGHT}' (the policy scores each batch without the "
                    f"hindsight block as the student), not {against!r}"
                )
            if params is not None:
                raise ValueError("params= are HCAPO's: a log-ratio run takes log_ratio=LogRatioParams(...)")
        elif against is not None or log_ratio is not None or allow_mixed:
            raise ValueError("against=, log_ratio= and allow_mixed= apply to variant='log-ratio' only")
        self.variant, self.against, self.allow_mixed = variant, against, allow_mixed
        # the library's defaults (credits/log_ratio.py) with GRPO per batch group as the backbone
        self.log_ratio = (log_ratio or LogRatioParams(grpo=True, group_by=GROUP_TAG)) if variant == VARIANT else None
        self.students: dict[int, str] = {}  # step -> the log-ratio's student scorer id
        self.store = store
        # in every episode id, file name and weight version: JSONL ids are scoped by file name, and a
        # restarted training run must not make its step 0 a new version of the last run's step 0
        self.run_id = run_id or uuid.uuid4().hex[:8]
        self.tokenizer = str(tokenizer)
        # loaded on the first batch, then only when the directory's tokenizer files change
        self.kept_tokenizer = KeptTokenizer(self.tokenizer)
        self.workdir = Path(workdir)
        # the library's defaults (credits/params.py): the paper's terminal return on outcome-only rollouts
        self.params = params or CreditParams(variant="paper", group_by=GROUP_TAG)
        self.allow_zero_hindsight = allow_zero_hindsight
        self._told_tools = False  # the tools warning, once
        # per step, its training batch's (the last one at that step): evaluation batches keep out
        self.signals: dict[int, CreditSignal] = {}  # step -> its batch's hindsight signal (credits/signal.py)
        self.last_signal: CreditSignal | None = None  # the last batch's, of any mode (None: nothing stored)
        super().__init__(None, self.episode_name, strict=strict)  # its handoff is per batch: see __call__
        self.runs: dict[int, str] = {}  # step -> credit run name
        self.scorers: dict[int, str] = {}  # step -> scorer id (the policy at that step's weights)
        self.episodes: dict[int, list[str | None]] = {}  # step -> store episode name per row (None: left out)

    def _begin(self, batch: RolloutBatch) -> None:
        """A new batch's records, these too: no last signal yet; a training batch leaves none of
        an earlier batch's at its step."""
        super()._begin(batch)
        self.last_signal = None
        if batch.mode == "train":
            for records in (self.signals, self.runs, self.scorers, self.episodes, self.students):
                records.pop(batch.step, None)

    def episode_name(self, batch: RolloutBatch, row: int) -> str:
        """The store's name of a row's episode (after ``__call__`` stored it)."""
        name = self.episodes.get(batch.step, [])[row] if row < len(self.episodes.get(batch.step, [])) else None
        if name is None:
            raise HandoffError(f"step {batch.step}, row {row}: not in the store ({self.last_skipped.get(row)})")
        return name

    def _external_id(self, step: int, suffix: str, row: int) -> str:
        return f"{self.run_id}-s{step}{suffix}-r{row}"

    def _suffix(self, batch: RolloutBatch) -> str:
        """What tells this batch from the run's others at its step: "" for step N's (first)
        training batch, ``-eval`` for an evaluation pass's, ``.K`` after it for the K-th more of
        those at that step (TRL generates twice a step when steps_per_generation <
        gradient_accumulation_steps; a restart that reuses ``run_id`` finds its folders taken).
        In the batch's folder, files, episode ids (``sN`` + it) and group tags: its groups hold its
        rollouts only. Before, a later batch of a step found the earlier one's episodes under the
        same file and counted them into its GRPO groups."""
        base = "" if batch.mode == "train" else f"-{batch.mode}"
        suffix, k = base, 0
        while self._taken(batch.step, suffix):
            k += 1
            suffix = f"{base}.{k}"
        return suffix

    def _taken(self, step: int, suffix: str) -> bool:
        """Whether a batch already went by these names: its folder in the workdir, or its episodes
        in the store (a restart reusing ``run_id`` with another workdir: JSONL episodes are keyed by
        file name, so its rows would be the earlier run's episodes, "unchanged", or new versions of
        them, and the batch trained on zeros)."""
        if self._folder(step, suffix).exists():
            return True
        prefix = f"jsonl:{self._file_stem(step, suffix)}_g"
        rows = self.store.query(
            "SELECT 1 FROM episodes WHERE substr(source_key, 1, :n) = :p LIMIT 1", {"n": len(prefix), "p": prefix}
        )[1]
        return bool(rows)

    def _folder(self, step: int, suffix: str) -> Path:
        return self.workdir / self.run_id / f"step_{step:06d}{suffix}"

    def _file_stem(self, step: int, suffix: str) -> str:
        return f"{self.run_id}_step{step:06d}{suffix}"

    def _messages(self, batch: RolloutBatch, i: int) -> list[dict[str, Any]]:
        prompt, completion = batch.prompts[i], batch.completions[i]
        if not (isinstance(prompt, list) and isinstance(completion, list)):
            raise HandoffError(
                "StoreAdvantages needs a conversational dataset (a `prompt` column of messages): the store renders "
                "episodes with the chat template, as TRL does for conversational prompts"
            )
        return [dict(m) for m in prompt] + [dict(m) for m in completion]

    def _write(self, batch: RolloutBatch, suffix: str) -> dict[int, list[tuple[int, Path]]]:
        """Each group's rows as a JSONL file of episodes; which rows went into which file."""
        folder = self._folder(batch.step, suffix)
        folder.mkdir(parents=True)
        files: dict[int, list[tuple[int, Path]]] = {}
        lines: dict[int, list[str]] = {}
        for i, group in enumerate(batch.groups):
            if not math.isfinite(batch.rewards[i]):
                self._skip(batch, i, "no reward function scored it (TRL gives it no advantage either)")
                continue
            path = folder / f"{self._file_stem(batch.step, suffix)}_g{group:05d}.jsonl"
            episode = {
                "episode_id": self._external_id(batch.step, suffix, i),
                "reward": batch.rewards[i],
                "messages": self._messages(batch, i),
            }
            lines.setdefault(group, []).append(json.dumps(episode, ensure_ascii=False))
            files.setdefault(group, []).append((i, path))
        for group, group_lines in lines.items():
            files[group][0][1].write_text("".join(line + "\n" for line in group_lines), encoding="utf-8")
        return files

    def __call__(self, batch: RolloutBatch) -> list[np.ndarray]:
        from hcapo_store.credits.compute import compute_credits
        from hcapo_store.ingestion.pipeline import ingest
        from hcapo_store.scoring.live import score_live
        from hcapo_store.training.handoff import Handoff

        if batch.model is None:
            raise HandoffError("StoreAdvantages scores rollouts with the policy: the batch carries no model")
        if batch.processes != 1:
            # a GRPO group's rows may sit in several processes: per-process credits would have
            # per-process group statistics
            raise HandoffError(
                f"StoreAdvantages runs in one training process, not {batch.processes}: pass advantages= a "
                "callable that gathers the batch first"
            )
        out = [np.zeros(len(ids), dtype=np.float64) for ids in batch.completion_ids]
        self._begin(batch)
        if batch.tools and not self._told_tools:
            import warnings

            self._told_tools = True
            warnings.warn(
                f"the trainer has {batch.tools} tool(s): the store keeps the rollouts' messages but not the tool "
                "definitions, so the hindsight scores are of prompts without them (the policy saw them); "
                "each step is still placed on its own tokens",
                stacklevel=2,
            )
        train = batch.mode == "train"  # the step's records are its training batch's, an evaluation's stay out
        suffix = self._suffix(batch)
        files = self._write(batch, suffix)
        if not files:
            return out
        names: dict[int, str] = {}
        episode_ids: list[int] = []
        for group, rows in files.items():
            path = rows[0][1]
            report = ingest(self.store, [path], tags={GROUP_TAG: f"step-{batch.step}{suffix}/g{group}"}, jobs=1)
            # a rollout the store refuses (e.g. an empty completion) is left at 0 and listed, never the batch
            why = {src.rsplit(":", 1)[-1]: reason for src, reason in [*report.skips, *report.failures]}
            found = self.store.query(
                "SELECT id, name, external_id FROM episodes WHERE source_path = :p AND is_current",
                {"p": str(path.resolve())},
            )[1]
            by_row = {str(ext): name for _, name, ext in found}
            episode_ids += [int(i) for i, _, _ in found]
            for line, (i, _) in enumerate(rows, 1):
                if self._external_id(batch.step, suffix, i) in by_row:
                    names[i] = by_row[self._external_id(batch.step, suffix, i)]
                else:
                    self._skip(batch, i, f"not stored: {why.get(str(line), 'the ingest did not keep it')}")
        if train:
            self.episodes[batch.step] = [names.get(i) for i in range(len(batch.completion_ids))]
        if not names:
            return out
        version = f"{self.run_id}/step-{batch.step}"
        tokenizer = self.kept_tokenizer.get()  # one object for the batch's scoring and hand-off
        # a log-ratio run places per-token values: scored on the completion's own tokens
        span = "policy" if self.log_ratio is not None else "rendered"
        live = score_live(
            self.store,
            batch.model,
            tokenizer=self.tokenizer,
            weight_version=version,
            episodes=list(names.values()),
            action_span=span,
            loaded_tokenizer=tokenizer,
        )
        if live.report.failed:
            raise HandoffError(f"step {batch.step}: scoring the rollouts failed: {live.report.first_errors}")
        if self.log_ratio is None:
            run = compute_credits(self.store, self.params, scorer=live.scorer_id, episodes=episode_ids)
        else:
            run = self._log_ratio_run(batch, version, list(names.values()), live.scorer_id, episode_ids, tokenizer)
        if train:
            self.runs[batch.step] = run.run.name
            self.scorers[batch.step] = live.scorer_id
        # a batch whose hindsight term is zero on every step is refused (plain GRPO) unless opted into
        handoff = Handoff(
            self.store,
            run.run.name,
            tokenizer=self.tokenizer,
            allow_zero_hindsight=self.allow_zero_hindsight,
            loaded_tokenizer=tokenizer,
        )
        self.last_signal = handoff.signal
        if handoff.signal is not None and train:
            self.signals[batch.step] = handoff.signal
        # a row nothing of which is trained (a masked truncated completion) is not looked up
        trained = {i: name for i, name in names.items() if any(batch.loss_mask[i])}
        handoff.prefetch(handoff.episode_id(name) for name in trained.values())  # the batch's episodes in one read
        for i, name in trained.items():
            out[i] = self.row(handoff, batch, i, name)
        return out

    def _log_ratio_run(
        self,
        batch: RolloutBatch,
        version: str,
        names: list[str],
        teacher: str,
        episode_ids: list[int],
        tokenizer: Any,
    ) -> Any:
        """The batch's log-ratio run: the policy without the hindsight block is the student."""
        from hcapo_store.credits.log_ratio import compute_log_ratio
        from hcapo_store.scoring.live import score_live

        assert self.log_ratio is not None
        student = score_live(
            self.store,
            batch.model,
            tokenizer=self.tokenizer,
            weight_version=version,
            episodes=names,
            action_span="policy",
            hindsight=False,
            loaded_tokenizer=tokenizer,
        )
        if student.report.failed:
            raise HandoffError(
                f"step {batch.step}: scoring the rollouts without the hindsight block failed: "
                f"{student.report.first_errors}"
            )
        if batch.mode == "train":
            self.students[batch.step] = student.scorer_id
        return compute_log_ratio(
            self.store,
            self.log_ratio,
            scorer=teacher,
            against=student.scorer_id,
            allow_mixed=self.allow_mixed,
            episodes=episode_ids,
        )


__all__ = [
    "GROUP_TAG",
    "HandoffAdvantages",
    "TRL_VERSIONS",
    "AdvantageSource",
    "HCAPOGRPOTrainer",
    "RolloutBatch",
    "StoreAdvantages",
    "check_trl",
    "place",
    "trl_advantages",
]
