"""The engine loop: schedule -> execute -> sample -> update, with detokenization and stop strings."""

from __future__ import annotations

import itertools
import json
import logging
from dataclasses import dataclass

from transformers import AutoTokenizer

from turnout.config import EngineConfig
from turnout.engine.block_manager import BlockManager
from turnout.engine.detokenizer import Detokenizer
from turnout.engine.request import Request
from turnout.engine.scheduler import Scheduler
from turnout.errors import ConfigError, RequestError, TurnoutError
from turnout.models.info import ModelInfo
from turnout.sampling_params import SamplingParams
from turnout.selection import Selection, select_all

logger = logging.getLogger("turnout")


def resolve_model_dir(config: EngineConfig) -> str:
    if config.model:
        return config.model
    from turnout.loader.default_model import default_model_path

    return str(default_model_path())


@dataclass
class StepOutput:
    req: Request
    delta: str  # text added this step
    finished: bool


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        model_dir = resolve_model_dir(config)
        self.info = ModelInfo.from_dir(model_dir)
        if config.pipeline_parallel_size > self.info.num_layers:
            raise ConfigError(
                f"pipeline_parallel_size {config.pipeline_parallel_size} exceeds the model's "
                f"{self.info.num_layers} layers; every stage needs at least one layer"
            )
        self.selection: Selection = select_all(config, self.info)
        self.tokenizer = AutoTokenizer.from_pretrained(config.tokenizer or model_dir)
        self.executor = self.selection.executor_spec.load()(config, self.selection)
        try:
            self._init_kv_cache()
        except BaseException:
            self.executor.shutdown()
            raise
        self.eos_token_ids = self._eos_ids(model_dir)
        self.requests: dict[str, Request] = {}
        self.detok: dict[str, Detokenizer] = {}
        self._ids = itertools.count()

    def _init_kv_cache(self) -> None:
        cfg = self.config
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
        capacity = num_blocks * cfg.block_size
        self.max_model_len = min(cfg.max_model_len or model_max, capacity)
        logger.info(
            "KV cache: %d blocks of %d tokens = %d tokens; max_model_len %d",
            num_blocks, cfg.block_size, capacity, self.max_model_len,
        )  # fmt: skip
        bm = BlockManager(num_blocks, cfg.block_size, cfg.enable_prefix_caching)
        self.scheduler = Scheduler(bm, cfg.max_num_seqs, cfg.max_num_batched_tokens, self.max_model_len)

    def _eos_ids(self, model_dir: str) -> list[int]:
        ids = set(self.info.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
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
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=True) if prompt else []
        return list(prompt)

    def add_request(
        self, prompt: str | list[int], params: SamplingParams, req_id: str | None = None
    ) -> Request:
        """Validate and queue one request; a bad one raises RequestError and changes nothing."""
        token_ids = self.tokenize(prompt)
        vocab = self.info.hf_config.get("vocab_size", 1 << 62)
        if not token_ids:
            raise RequestError("empty prompt; pass at least one token of text")
        if len(token_ids) >= self.max_model_len:
            raise RequestError(
                f"prompt is {len(token_ids)} tokens, but max_model_len is {self.max_model_len} "
                "(prompt plus at least one new token); shorten the prompt or raise max_model_len"
            )
        if min(token_ids) < 0 or max(token_ids) >= vocab:
            raise RequestError(
                f"prompt token ids must lie in [0, {vocab}); got {min(token_ids)}..{max(token_ids)}"
            )
        req_id = req_id or str(next(self._ids))
        if req_id in self.requests:
            raise RequestError(f"request id {req_id} is already in use; pick another")
        req = Request(req_id, token_ids, params, self.eos_token_ids)
        self.requests[req_id] = req
        self.detok[req_id] = Detokenizer(self.tokenizer)
        self.scheduler.add(req)
        return req

    def abort(self, req_id: str) -> None:
        if (req := self.requests.get(req_id)) is not None:
            self.scheduler.finish(req, "abort")

    def abort_request(self, req_id: str) -> None:
        """Abort and forget the request: its KV blocks are free when this returns (unknown id: no-op)."""
        if req_id in self.requests:
            self.abort(req_id)
            del self.requests[req_id], self.detok[req_id]

    def pop_finished(self, req_id: str) -> tuple[Request, str]:
        self._detokenize(self.requests[req_id])  # catch up: an aborted request's text was never read
        return self.requests.pop(req_id), self.detok.pop(req_id).text

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- the loop ----
    def step(self) -> list[StepOutput]:
        out = self.scheduler.schedule()
        if not out.requests:
            if out.finished_req_ids:  # let workers drop state of aborted requests
                self.executor.execute_model(out)
            return []
        res = self.executor.step(out)
        for req_id, (lp, top) in res.logprobs.items():
            self.requests[req_id].logprobs.append(lp)
            self.requests[req_id].top_logprobs.append(top)
        finished = {r.req_id for r in self.scheduler.update(out, res.sampled, self.requests)}
        outputs = []
        for req_id in res.sampled:
            req = self.requests[req_id]
            # Text is made when read: each step for streams and stop strings, else once at the end.
            wanted = req.stream or req.params.stop or req.is_finished
            delta = self._detokenize(req) if wanted else ""
            outputs.append(StepOutput(req, delta, req_id in finished or req.is_finished))
        return outputs

    def _detokenize(self, req: Request) -> str:
        d = self.detok[req.req_id]
        out_ids = req.output_token_ids
        if req.is_finished and out_ids and out_ids[-1] in req.eos_token_ids + req.params.stop_token_ids:
            out_ids = out_ids[:-1]  # vLLM keeps the stop token in token_ids, not in text
        before = len(d.text)
        delta = d.step(out_ids, final=req.is_finished)
        if req.params.stop and delta and (i := d.find_stop(req.params.stop, len(delta))) is not None:
            d.text = d.text[:i]
            delta = d.text[before:]
            self.scheduler.finish(req, "stop")
        return delta

    def stats(self) -> dict[str, float]:
        bm = self.scheduler.bm
        return {
            "prefix_cache_queries": bm.stats.queries,
            "prefix_cache_hits": bm.stats.hits,
            "prefix_cache_hit_rate": round(bm.stats.hit_rate, 4),
            "preemptions": self.scheduler.num_preemptions,
            "free_blocks": bm.num_free_blocks,
            "total_blocks": bm.num_blocks,
        }

    def shutdown(self) -> None:
        self.executor.shutdown()
