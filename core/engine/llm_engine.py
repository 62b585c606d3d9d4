"""The engine loop: schedule -> execute -> sample -> update, with detokenization and stop strings.

With async scheduling one step stays in flight between calls: `step` schedules and launches step N+1, then
reads step N's tokens (copied to the host while N+1 runs) and updates from them, so the host's work for
N+1 overlaps N's forward on the device.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from transformers import AutoTokenizer

from turnout.attention.kv_spec import kv_cache_config
from turnout.config import EngineConfig
from turnout.engine.block_manager import BlockManager
from turnout.engine.detokenizer import Detokenizer
from turnout.engine.main_guard import check_main_guard
from turnout.engine.request import Request
from turnout.engine.scheduler import Scheduler, SchedulerOutput
from turnout.errors import ConfigError, RequestError, TurnoutError
from turnout.models.info import ModelInfo
from turnout.prompts import context_problem
from turnout.sampling_params import SamplingParams
from turnout.selection import Selection, select_all
from turnout.structured_outputs.manager import StructuredOutputManager

if TYPE_CHECKING:
    from turnout.structured_outputs import GrammarOutput
    from turnout.worker.outputs import ModelRunnerOutput

logger = logging.getLogger("turnout")


def resolve_model_dir(config: EngineConfig) -> str:
    """The HF-style folder to load: config.model, a cached conversion of a .gguf file, or the default."""
    from turnout.loader.default_model import default_model_path, gguf_model_path

    if config.model and not Path(config.model).exists():
        raise ConfigError(
            f"model {config.model} does not exist; pass an HF-style model folder or a .gguf file"
        )
    if config.model and config.model.endswith(".gguf"):
        return str(gguf_model_path(config.model))
    return config.model or str(default_model_path())


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json", "vocab.txt")


def require_tokenizer(tokenizer: Any, problem: str, what: str) -> Any:
    """tokenizer, or RequestError where it is None: `what` needs one, why there is none (problem, which names
    the fix)."""
    if tokenizer is None:
        raise RequestError(f"{what} need a tokenizer, but {problem}")
    return tokenizer


def load_tokenizer(config: EngineConfig, model_dir: str) -> tuple[Any, str]:
    """(the tokenizer, "") or, where text prompts cannot be tokenized, (None, why, with the fix). Prompts of
    token ids need none: a model folder without a usable tokenizer starts, with one warning; a `tokenizer`
    the user named that does not load is a ConfigError."""
    if config.skip_tokenizer_init:
        return None, "skip_tokenizer_init is set; pass token ids, or unset skip_tokenizer_init"
    path = config.tokenizer or model_dir
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except Exception as e:  # transformers raises OSError, ValueError, ImportError, ... for what it lacks
        why = f"transformers cannot load it: {' '.join(str(e).split())[:200]}"
        if Path(path).is_dir() and not any((Path(path) / f).exists() for f in TOKENIZER_FILES):
            why = f"none of {', '.join(TOKENIZER_FILES)} is there"
    else:
        if set(tokenizer.get_vocab().values()) - set(tokenizer.all_special_ids):
            return tokenizer, ""
        why = "transformers finds no vocabulary there, only special tokens (its empty fallback)"
    if config.tokenizer:
        raise ConfigError(f"tokenizer {path} is not usable: {why}; pass a tokenizer folder that loads")
    problem = (
        f"model folder {path} has no usable tokenizer: {why}; add the model's tokenizer files to it, "
        "or pass tokenizer=<a folder with them>"
    )
    logger.warning("prompts of token ids only: %s", problem)
    return None, problem


@dataclass
class StepOutput:
    req: Request
    delta: str  # text added this step
    finished: bool


@dataclass
class LaunchedStep:
    """A step handed to the executor, whose sampled tokens are read later."""

    out: SchedulerOutput
    requests: dict[str, Request]  # held: the engine may pop an id, or reuse it, before the step is read
    read: Callable[[], ModelRunnerOutput]  # waits for the sampled tokens
    feeds_next: bool  # its tokens must reach the host before the next step: penalties, bad words


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        model_dir = resolve_model_dir(config)
        self.info = ModelInfo.from_dir(model_dir)
        self.selection: Selection = select_all(config, self.info)
        self.config = config = self.selection.apply(config)
        if self.selection.platform.is_cuda:
            from turnout.loader.default_model import cache_dir

            # Triton's compiled kernels live beside turnout's other caches, for every rank this spawns.
            os.environ.setdefault("TRITON_CACHE_DIR", str(cache_dir() / "triton"))
        self.tokenizer, self.tokenizer_problem = load_tokenizer(config, model_dir)
        executor_cls = self.selection.executor_spec.load()
        if getattr(executor_cls, "start_method", None) == "spawn":
            check_main_guard(
                f"a {config.world_size}-rank engine (executor {self.selection.executor.chosen.name})"
            )
        self.executor = executor_cls(config, self.selection)
        self.async_scheduling = self.selection.async_scheduling
        self._in_flight: LaunchedStep | None = None
        self.eos_token_ids = self._eos_ids(model_dir)
        vocab = self.info.hf_config.get("vocab_size") or len(self.tokenizer or ())
        self.structured = StructuredOutputManager(
            config.structured_outputs_backend, self.tokenizer, vocab, self.eos_token_ids,
            pin_memory=self.selection.platform.is_cuda,
        )  # fmt: skip
        self.requests: dict[str, Request] = {}
        self.detok: dict[str, Detokenizer] = {}
        self._ids = itertools.count()
        try:
            self._init_kv_cache()
            if self.selection.platform.is_cuda:
                self._warm_up()
        except BaseException:
            self.executor.shutdown()
            raise

    def _init_kv_cache(self) -> None:
        cfg = self.config
        specs = self.executor.collective_rpc("kv_cache_specs")  # rank = pp_rank * tp + tp_rank
        self.kv_cache_config = kv_cache_config(specs[:: cfg.tensor_parallel_size])
        self.executor.collective_rpc("set_kv_cache_config", (self.kv_cache_config,))
        num_blocks = min(self.executor.collective_rpc("determine_num_blocks"))
        if num_blocks < 1:
            raise TurnoutError(
                "no memory left for the KV cache after loading the model; raise gpu_memory_utilization "
                "or cpu_kv_cache_bytes, or lower max_num_batched_tokens"
            )
        self.executor.collective_rpc("init_kv_cache", (num_blocks,))
        model_max = self.info.max_position_embeddings
        if cfg.max_model_len and cfg.max_model_len > model_max:
            raise ConfigError(f"max_model_len {cfg.max_model_len} exceeds the model's {model_max}; lower it")
        capacity = self.kv_cache_config.max_tokens(num_blocks, cfg.max_num_batched_tokens)
        self.max_model_len = min(cfg.max_model_len or model_max, capacity)
        groups = "; ".join(self.kv_cache_config.describe())
        # a block id over every stage of one tensor-parallel rank, a token's share
        per_block = sum(self.executor.collective_rpc("kv_bytes_per_block")[:: cfg.tensor_parallel_size])
        concurrency = self.kv_cache_config.max_concurrency(
            num_blocks, self.max_model_len, cfg.max_num_batched_tokens
        )
        logger.info(
            "KV cache: %d blocks of %d tokens (%d bytes a token a rank) = %d tokens a request in %s; "
            "max_model_len %d, maximum concurrency for max_model_len tokens a request: %.2fx; %s",
            num_blocks, cfg.block_size, per_block // cfg.block_size, capacity,
            self.selection.kv_cache_description(), self.max_model_len, concurrency, groups,
        )  # fmt: skip
        self.num_blocks = num_blocks
        self.scheduler = self._new_scheduler()

    def _new_scheduler(self) -> Scheduler:
        """An empty scheduler over all num_blocks KV blocks (no prefix-cache entries, no statistics)."""
        cfg = self.config
        bm = BlockManager(
            self.num_blocks, cfg.block_size, cfg.enable_prefix_caching, self.kv_cache_config.specs
        )
        return Scheduler(bm, cfg.max_num_seqs, cfg.max_num_batched_tokens, self.max_model_len)

    def _warm_up(self) -> None:
        """Run synthetic requests through the real step path before the first user request, so that the
        kernels a workload hits are compiled (or loaded from the on-disk cache) at start-up: for each
        power-of-two band of sequence length up to the token budget, a prefill step, a mixed step (a decode
        row beside a prefill chunk), a mixed step of mostly decode rows (two beside a two-token prompt,
        which a per-phase pair runs on its decode half), decode steps and, with prefix caching, a prefill
        after a cached prefix. A longer prompt runs in chunks of at most the budget, and the FULL decode
        graphs are captured at max_model_len, so bands past the budget would only spend GPU time. The
        scheduler and its prefix cache are replaced afterwards, so no warm-up block or statistic outlives
        it."""
        t0 = time.perf_counter()
        vocab = self.info.hf_config.get("vocab_size", 32000)
        tokens = lambda n, salt: [(salt * 7919 + i * 104729) % vocab for i in range(n)]
        sample = SamplingParams(temperature=0.6, top_p=0.9, seed=0, max_tokens=3, ignore_eos=True)
        greedy = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
        length, steps = 16, 0
        while True:
            # c: n + 3 prompt tokens and 2 outputs fit
            n = min(length + 1, self.max_model_len - 5, self.config.max_num_batched_tokens)
            self.add_request(tokens(n, length), sample, req_id=f"warmup-{length}-a")
            self.step()
            self.add_request(tokens(n // 2 + 1, length + 1), greedy, req_id=f"warmup-{length}-b")
            self.step()
            self.add_request(tokens(2, length + 2), greedy, req_id=f"warmup-{length}-d")
            steps += 2 + self._run_to_end()
            if self.config.enable_prefix_caching:  # after a's full blocks, now cached
                self.add_request(tokens(n, length) + [1] * 3, greedy, req_id=f"warmup-{length}-c")
                steps += self._run_to_end()
            if n < length + 1:
                break
            length *= 2
        widest, wide_steps = self._warm_up_widest(tokens)
        steps += wide_steps
        self.step()  # hands the last finished ids to the workers, which drop their per-request state
        for req_id in list(self.requests):
            self.pop_finished(req_id)
        self.scheduler = self._new_scheduler()
        dt = time.perf_counter() - t0
        logger.info("warm-up: %d steps up to %d tokens and %d requests in %.1fs", steps, n, widest, dt)

    def _warm_up_widest(self, tokens: Callable[[int, int], list[int]]) -> tuple[int, int]:
        """The widest batches: max_num_seqs - 1 two-token prompts prefill in one step, then one more joins
        their decode rows, a mixed step of max_num_seqs requests. Kernels may pick their variant by batch
        size (FA4 adds a batch lookup past 256 requests), so wide decode's first steps must not compile.
        Returns (the most requests a step ran, steps)."""
        params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)  # running after the mixed step
        width = min(self.config.max_num_seqs, self.config.max_num_batched_tokens // 2)
        for i in range(width - 1):
            self.add_request(tokens(2, 3 * i + 1), params, req_id=f"warmup-wide-{i}")
        self.step()
        self.add_request(tokens(2, 3 * width), params, req_id="warmup-wide-last")
        self.step()
        widest = len(self.scheduler.running)
        return widest, 2 + self._run_to_end()

    def _run_to_end(self) -> int:
        """Step until every request has finished; the number of steps."""
        steps = 0
        while self.has_unfinished():
            self.step()
            steps += 1
        return steps

    def _eos_ids(self, model_dir: str) -> list[int]:
        ids = set(self.info.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        try:
            with open(f"{model_dir}/generation_config.json") as f:
                eos = json.load(f).get("eos_token_id")
            ids.update([eos] if isinstance(eos, int) else eos or [])
        except (OSError, ValueError):
            pass
        return sorted(ids)

    # ---- requests ----
    def tokenize(self, prompt: str | list[int]) -> list[int]:
        """Text with the tokenizer's special tokens, or token ids as they are."""
        if not isinstance(prompt, str):
            return list(prompt)
        return self.need_tokenizer("text prompts").encode(prompt, add_special_tokens=True) if prompt else []

    def need_tokenizer(self, what: str) -> Any:
        """The tokenizer, or RequestError: `what` needs one, why this engine has none, and the fix."""
        return require_tokenizer(self.tokenizer, self.tokenizer_problem, what)

    def add_request(
        self, prompt: str | list[int], params: SamplingParams, req_id: str | None = None
    ) -> Request:
        """Validate and queue one request; a bad one raises RequestError and changes nothing."""
        token_ids, params = self.check_request(prompt, params)
        req_id = req_id or str(next(self._ids))
        if req_id in self.requests:
            raise RequestError(f"request id {req_id} is already in use; pick another")
        req = Request(req_id, token_ids, params, self.eos_token_ids)
        self.requests[req_id] = req
        self.detok[req_id] = Detokenizer(self.tokenizer, params.skip_special_tokens)
        if params.structured_outputs is not None:
            self.structured.add(req_id, params.structured_outputs)
        self.scheduler.add(req)
        return req

    def check_request(
        self, prompt: str | list[int], params: SamplingParams
    ) -> tuple[list[int], SamplingParams]:
        """The prompt's token ids and the params the engine runs, or RequestError saying what to change."""
        token_ids = self.tokenize(prompt)
        vocab = self.info.hf_config.get("vocab_size", 1 << 62)
        if not token_ids:
            raise RequestError("empty prompt; pass at least one token of text")
        model_max = self.info.max_position_embeddings
        if problem := context_problem(len(token_ids), params.max_tokens, self.max_model_len, model_max):
            raise RequestError(problem)  # as vLLM's server: the whole request fits, or none of it runs
        if min(token_ids) < 0 or max(token_ids) >= vocab:
            raise RequestError(
                f"prompt token ids must lie in [0, {vocab}); got {min(token_ids)}..{max(token_ids)}"
            )
        return token_ids, self._accept(params, vocab)

    def _accept(self, params: SamplingParams, vocab: int) -> SamplingParams:
        """Checks that need the engine, and a copy of params with the engine's EOS and bad-word ids."""
        cap = self.config.max_logprobs
        for name in ("logprobs", "prompt_logprobs"):
            if (v := getattr(params, name)) is not None and v > cap:
                raise RequestError(
                    f"{name}={v} exceeds max_logprobs {cap}; ask for at most {cap}, "
                    "or raise the engine setting max_logprobs"
                )
        for name, ids in (("logit_bias", params.logit_bias or {}), ("stop_token_ids", params.stop_token_ids)):
            if bad := [t for t in ids if t >= vocab]:
                raise RequestError(f"{name} names token id {bad[0]}, outside the vocabulary [0, {vocab})")
        if params.stop or params.bad_words:
            self.need_tokenizer("stop strings" if params.stop else "bad_words")
        if params.structured_outputs is not None:
            self.need_tokenizer("structured outputs")
            self.structured.compile(params.structured_outputs)  # one that does not compile fails here
        params = dataclasses.replace(params)
        params.eos_token_ids = self.eos_token_ids
        for word in params.bad_words or []:  # at the start of the text and after a space, as in vLLM
            for text in (word.lstrip(), " " + word.lstrip()):
                ids = self.tokenizer.encode(text, add_special_tokens=False)
                if ids and ids not in params.bad_words_token_ids:
                    params.bad_words_token_ids.append(ids)
        return params

    def abort(self, req_id: str) -> None:
        if (req := self.requests.get(req_id)) is not None:
            self.scheduler.finish(req, "abort")

    def abort_request(self, req_id: str) -> None:
        """Abort and forget the request: its KV blocks are free when this returns (unknown id: no-op)."""
        if req_id in self.requests:
            self.abort(req_id)
            del self.requests[req_id], self.detok[req_id]
            self.structured.remove(req_id)

    def pop_finished(self, req_id: str) -> tuple[Request, str]:
        self._detokenize(self.requests[req_id])  # catch up: an aborted request's text was never read
        self.structured.remove(req_id)
        return self.requests.pop(req_id), self.detok.pop(req_id).text

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self._in_flight is not None

    # ---- the loop ----
    @property
    def _sync(self) -> bool:
        """Steps are launched and read one at a time (no async scheduling)."""
        return not self.async_scheduling

    def step(self) -> list[StepOutput]:
        """One turn of the loop; returns the outputs of the step read in it.

        Sync: schedule step N, launch it, read it. Async, with step N in flight when called:
        1. N feeds the next schedule (a request's sampling needs its output tokens: penalties, bad words):
           read N and return; the next call launches N + 1.
        2. Schedule N + 1 (N's tokens are placeholders the runner fills on the device) and launch it.
        3. With structured outputs, the executor calls grammar() between N + 1's forward and its sampling:
           N is read there, so its tokens reach the grammars before N + 1's bitmask is made.
        4. Read N (if 3 did not) and return its outputs; N + 1 stays in flight.
        Invariant: at most one step is in flight, and every launched step is read once, in launch order."""
        prev = self._in_flight  # stays in flight until read or replaced: an interrupt never loses it
        if prev is not None and (prev.feeds_next or self._sync):
            self._in_flight = None
            return self._read(prev)
        out = self.scheduler.schedule()
        if not out.requests:
            self._idle(out)
            self._in_flight = None
            return self._read(prev)
        reqs = {s.req_id: self.requests[s.req_id] for s in out.requests}
        read: list[StepOutput] | None = None

        def grammar() -> GrammarOutput | None:
            nonlocal read
            if prev is not None:
                read = self._read(prev)
            return self.structured.grammar_output(
                [s.req_id for s in out.requests if s.sample and not reqs[s.req_id].is_finished]
            )

        launched = self._launch(out, reqs, grammar if self.structured.active else None)
        if self._sync:
            return self._read(launched)
        self._in_flight = launched
        return read if read is not None else self._read(prev)

    def _launch(
        self,
        out: SchedulerOutput,
        reqs: dict[str, Request],
        grammar: Callable[[], GrammarOutput | None] | None,
    ) -> LaunchedStep:
        """Hand a scheduled step to the executor; grammar (None without structured outputs) runs between its
        forward and its sampling. Sync: the tokens are back when this returns."""
        if self._sync:
            res = self.executor.step(out, grammar)
            return LaunchedStep(out, reqs, lambda: res, False)
        feeds_next = any(s.sample and s.params.needs_output_tokens for s in out.requests)
        return LaunchedStep(out, reqs, self.executor.step_async(out, grammar).get, feeds_next)

    def _idle(self, out: SchedulerOutput) -> None:
        """A step with no request to run: the executor still hears of it where others wait on it."""
        if self.config.expert_parallel_spans_dp:  # the other replicas' all-to-alls wait for our ranks
            self.executor.step(out)
        elif out.finished_req_ids:  # let workers drop state of aborted requests
            self.executor.execute_model(out)

    def _read(self, step: LaunchedStep | None) -> list[StepOutput]:
        """Wait for a launched step's tokens, update the scheduler; one output per request that got one."""
        if step is None:
            return []
        res = step.read()
        for req_id, (first, entries) in res.prompt_logprobs.items():
            have = step.requests[req_id].prompt_logprobs  # have[j] scores prompt token j + 1
            if first <= len(have) + 1:  # a recompute after preemption scores tokens again: keep the first
                have.extend(entries[len(have) + 1 - first :])
        outputs = []
        for req in self.scheduler.update(step.out, res.sampled, step.requests):
            if (entry := res.logprobs.get(req.req_id)) is not None:
                req.logprobs.append(entry)
            if self.structured.accept(req.req_id, req.output_token_ids[-1]) and not req.is_finished:
                self.scheduler.finish(req, "stop")  # the grammar is complete
            # Text is made when read: each step for streams and stop strings, else once at the end.
            wanted = req.stream or req.params.stop or req.is_finished
            delta = self._detokenize(req) if wanted else ""
            outputs.append(StepOutput(req, delta, req.is_finished))
        return outputs

    def _detokenize(self, req: Request) -> str:
        d, p = self.detok[req.req_id], req.params
        out_ids = req.output_token_ids
        if req.is_finished and req.hides_stop_token:
            out_ids = out_ids[:-1]  # vLLM keeps the stop token in token_ids, not in text
        before = len(d.text)
        delta = d.step(out_ids, final=req.is_finished)
        if p.stop and delta and len(out_ids) >= p.min_tokens and (hit := d.find_stop(p.stop, len(delta))):
            i, stop = hit
            d.text = d.text[: i + len(stop) if p.include_stop_str_in_output else i]
            delta = d.text[before:]
            if req.is_finished:  # ended by length or EOS in this very step: the stop string came first
                req.finish_reason, req.stop_reason = "stop", stop
            else:
                self.scheduler.finish(req, "stop", stop)
        return delta

    def stats(self) -> dict[str, float]:
        bm = self.scheduler.bm
        return {
            "prefix_cache_queries": bm.stats.queries,
            "prefix_cache_hits": bm.stats.hits,
            "prefix_cache_hit_rate": round(bm.stats.hit_rate, 4),
            "preemptions": self.scheduler.num_preemptions,
            "free_blocks": bm.num_free_blocks,
            "total_blocks": bm.num_pool_blocks,
        }

    def shutdown(self) -> None:
        self.executor.shutdown()
