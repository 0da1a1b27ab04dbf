"""Generator: one vLLM engine sampling responses under the current policy version.

Weight updates (``core.infra.weights.WeightReceiver``, received by ``EngineWeights`` in
actors/weight_receiver.py) run in their own Ray concurrency group (``actor_class``), so a
push reaches the actor while a generate call runs; ``EngineTurns`` keeps the two off the
engine at the same time. With ``partial_rollouts`` (async mode) a generate call steps the engine itself
and a push goes in between two engine steps instead of after the call:

* the requests in flight are preempted and recomputed from their tokens so far under the
  new weights (vLLM's ``reset_prefix_cache(reset_running_requests=True)``), so no token is
  sampled from KV that the old weights computed;
* vLLM labels each output token with the weight version that sampled it (its
  ``weight_versions`` spans); a rollout carries them as ``token_versions``, and its
  behaviour logprobs are, token by token, those of the version that sampled the token,
  which is what the learner's off-policy correction needs.
"""
from __future__ import annotations

import contextlib
import itertools
import logging
import os
import threading
import time

import numpy as np

from actors import kept_set
from actors.admitted_calls import AGENT_CALLS_CONCURRENCY, AGENT_CALLS_GROUP, AdmittedCalls
from actors.engine_turns import EngineTurns
from actors.environments.config import EnvConfig
from actors.environments.episodes import Turn
from actors.environments.runners import episode_runner
from actors.gateway.producer import agent_episodes
from actors.generation import GenerationResult, GenerationSummary, request_seed, token_versions
from actors.weight_receiver import GPU_TRANSFER, EngineWeights
from core.choices import TRANSPORT_NAMES, TRANSPORTS
from core.columns import PromptColumns
from core.infra.threads import fit_threads
from core.infra.weights import WEIGHT_UPDATE_GROUP
from core.modeling.engine_config import EngineConfig, SamplingConfig
from core.modeling.loading import resolve_model_path
from core.modeling.vllm_engine import check_served, start_engine
from core.rollout import Rollout
from core.sampling import is_truncated

log = logging.getLogger(__name__)


def engine_process_env(*, num_gpus: float, tensor_parallel: int, enforce_eager: bool = True) -> dict[str, str]:
    """Environment for an actor that hosts a Generator: where vLLM runs its engine.

    On CPU with one worker, vLLM's engine core and its worker run inside the actor's own
    process instead of two more processes that each import torch and vLLM: the engine
    starts in ~6 s instead of ~16 s on the tiny model (2 cores), each call skips two
    inter-process hops, and killing the actor takes the whole engine with it. GPU engines
    keep vLLM's own process layout. Only for actors: an in-process engine initialises
    torch.distributed in its process, which must not be one that also hosts a learner.

    An eager CPU engine also runs without torch.compile at all: vLLM compiles its sampler's
    token-rank count even with enforce_eager, which costs ~1.9 s of CPU at the first call
    with logprobs (so in every run's step 0, on the critical path of start-up) for a kernel
    that is one comparison and a sum.
    """
    if num_gpus or tensor_parallel != 1:
        return {}
    return {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", **({"TORCHDYNAMO_DISABLE": "1"} if enforce_eager else {})}


def actor_class():
    """Generator as a Ray actor class: weight updates and the gateway's calls get concurrency
    groups of their own (every generator actor must be made here: Ray kills an actor called in
    a group it lacks)."""
    import ray
    return ray.remote(concurrency_groups={WEIGHT_UPDATE_GROUP: 1, AGENT_CALLS_GROUP: AGENT_CALLS_CONCURRENCY})(
        Generator)


class Generator:
    """Hosts a vLLM engine; turns prompt token ids into Rollouts with behaviour logprobs."""

    def __init__(self, *, model: str, sampling: SamplingConfig | dict | None = None,
                 engine: EngineConfig | dict | None = None, name: str = "generator",
                 tensor_parallel: int = 1, weight_sync: str = "cpu", partial_rollouts: bool = False,
                 env: EnvConfig | None = None, columns: PromptColumns | None = None, gateway=None) -> None:
        """tensor_parallel: GPUs the engine spans (a pool resource). weight_sync: the learner's
        transport, "cpu" (load_weights of safetensors buckets), "nccl" or "ipc" (vLLM's NCCL or
        CUDA IPC weight transfer on GPU, on top of "cpu"). partial_rollouts: a weight push lands
        between two engine steps of a generate call rather than after it (module docstring).
        env: multi-turn episodes (the env section; actors/environments/episodes.py) instead of
        single responses, the environments given each prompt row's ``columns``; with env.agent,
        the agent's calls go through ``gateway`` (a Gateway actor, actors/gateway) to this generator."""
        fit_threads()
        model = resolve_model_path(model, name)
        if weight_sync not in TRANSPORTS:
            raise ValueError(f"{name}: weight_sync={weight_sync!r} is unknown; use {TRANSPORT_NAMES}")
        self.name, self.tensor_parallel, self.weight_sync = name, int(tensor_parallel), weight_sync
        self.sampling = sampling if isinstance(sampling, SamplingConfig) else SamplingConfig(**(sampling or {}))
        self.engine = engine if isinstance(engine, EngineConfig) else EngineConfig(**(engine or {}))
        self.partial_rollouts = bool(partial_rollouts)
        self._turns = EngineTurns()
        self._request_ids = itertools.count()
        self._skipped_total = 0
        self._generated_total = 0
        self._incomplete_kept_sets = 0  # positions whose kept set may go past the read (top-k ties)
        self._calls, self._calls_made = None, threading.Lock()  # the gateway's calls, admitted (serve_turn)
        if weight_sync in GPU_TRANSFER and not _has_cuda():
            raise ValueError(f"{name}: weight_sync={weight_sync!r} needs CUDA ({GPU_TRANSFER[weight_sync]}); "
                             "this generator has no GPU: use 'cpu' or give it num_gpus")
        t0 = time.perf_counter()
        check_served(model)  # one line for an architecture vLLM does not serve, not a failed engine
        self._llm = self._start_engine(model)  # built, stepped and loaded on a thread of its own
        self.weights = EngineWeights(llm=self._llm, turns=self._turns, name=name, weight_sync=weight_sync,
                                     partial_rollouts=self.partial_rollouts)
        self.start_seconds = time.perf_counter() - t0
        self._vocab_size = self._llm.llm_engine.model_config.get_vocab_size()
        kept_set.check_vocab(self.sampling.top_k, self.sampling.top_p, self._vocab_size, name)
        self.columns = columns if columns is not None else PromptColumns()
        if env is not None and env.agent:  # an agent's episodes, its calls through the run's gateway
            self.episodes = agent_episodes(env, gateway=gateway, name=name)
        else:
            self.episodes = None if env is None else episode_runner(
                env, self._llm.get_tokenizer(), max_context=self.engine.max_model_len,
                max_new_tokens=self.sampling.max_new_tokens, name=name)
        log.info("%s: vLLM engine up in %.1fs", name, self.start_seconds)

    def _start_engine(self, model: str):
        kwargs = dict(logprobs_mode="processed_logprobs",  # logprobs after temperature/top-k/top-p
                      max_logprobs=-1,  # top_p alone reads the whole vocabulary's (actors/kept_set.py)
                      worker_extension_cls="actors.vllm_extension.WeightReloadExtension")
        if _has_cuda():
            if self.weight_sync in GPU_TRANSFER:  # the worker builds vLLM's transfer engine after loading
                from vllm.config import WeightTransferConfig
                kwargs["weight_transfer_config"] = WeightTransferConfig(backend=self.weight_sync)
            if self.weight_sync == "ipc":
                # An IPC handle holds torch types, which vLLM's msgpack carries to its engine
                # process only as a pickle; both ends of that socket are this generator's own.
                os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
        if self.engine.max_lora_rank:  # the policy trains a LoRA adapter: pushes carry the adapter alone
            kwargs.update(enable_lora=True, max_lora_rank=self.engine.max_lora_rank, max_loras=1)
        return start_engine(model, self.engine, tensor_parallel=self.tensor_parallel, seed=self.sampling.seed,
                            on_gpu=_has_cuda(), **kwargs)

    def _params(self, prompt_indices: list[int]) -> list:
        """One SamplingParams per prompt, seeded by (seed, version, prompt index): a prompt's
        samples do not depend on which replica draws them or what else is in the batch's
        history, so a resumed or redispatched run samples what the original would have."""
        s = self.sampling
        kept_set.check_vocab(s.top_k, s.top_p, self._vocab_size, self.name)
        version = self.weights.version()
        return [self._request_params(s.max_new_tokens, n=s.n, ignore_eos=s.ignore_eos,
                                     seed=request_seed(s.seed, version, idx)) for idx in prompt_indices]

    def _request_params(self, max_tokens: int, *, n: int, ignore_eos: bool, seed: int):
        """One request's SamplingParams: the sampling section's distribution, the kept sets' log-probs."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        s = self.sampling
        return SamplingParams(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, max_tokens=max_tokens, n=n,
                              ignore_eos=ignore_eos, seed=seed, output_kind=RequestOutputKind.FINAL_ONLY,
                              **kept_set.logprob_request(s.top_k, s.top_p, self._vocab_size))

    def generate(self, prompt_ids: list, prompt_indices: list[int] | None = None) -> GenerationResult:
        """Sample `sampling.n` responses per prompt. prompt_ids: list of [P] int token arrays.

        Prompts that leave no room for a response within max_model_len are skipped
        and reported in `skipped_prompts`, not raised: one long row must not sink a batch.
        """
        if len(prompt_ids) == 0:
            raise ValueError(f"{self.name}.generate: empty prompt list")
        if prompt_indices is None:
            prompt_indices = list(range(len(prompt_ids)))
        if len(prompt_indices) != len(prompt_ids):
            raise ValueError(f"{self.name}.generate: {len(prompt_ids)} prompts but "
                             f"{len(prompt_indices)} prompt_indices")
        from vllm.inputs import TokensPrompt

        keep, skipped = [], []
        for ids, idx in zip(prompt_ids, prompt_indices):
            ids = [int(t) for t in ids]
            if not ids or len(ids) >= self.engine.max_model_len:
                skipped.append(idx)
            else:
                keep.append((ids, idx))
        self._skipped_total += len(skipped)
        if skipped:
            log.warning("%s: skipped %d prompts longer than max_model_len=%d (or empty)",
                        self.name, len(skipped), self.engine.max_model_len)
        if not keep:
            return GenerationResult([], GenerationSummary(0, tuple(skipped), version=self.weights.version()))

        t0 = time.perf_counter()
        if self.episodes is not None:
            return self._play(keep, skipped, t0)
        if self.partial_rollouts:
            outputs = self._step_engine([ids for ids, _ in keep], lambda: self._params([idx for _, idx in keep]))
        else:
            with self._turns.sampling():  # a push waits for the whole call
                outputs = self._llm.generate([TokensPrompt(prompt_token_ids=ids) for ids, _ in keep],
                                             self._params([idx for _, idx in keep]), use_tqdm=False,
                                             lora_request=self.weights.adapter)
        seconds = time.perf_counter() - t0
        read = [self._to_rollout(ids, idx, completion)
                for (ids, idx), out in zip(keep, outputs) for completion in out.outputs]
        rollouts = [r for r, _ in read]
        incomplete = sum(n for _, n in read)
        tokens = sum(len(r.response_ids) for r in rollouts)
        self._generated_total += tokens
        self._incomplete_kept_sets += incomplete
        return GenerationResult(rollouts, GenerationSummary(len(rollouts), tuple(skipped), tokens, seconds,
                                                            self.weights.version(), incomplete))

    def _play(self, keep: list[tuple[list[int], int]], skipped: list[int], t0: float) -> GenerationResult:
        """generate() as multi-turn episodes (actors/environments/episodes.py): the policy's tokens count."""
        incomplete = self._incomplete_kept_sets
        rollouts, counts = self.episodes.play(keep, self.columns, self._llm.get_tokenizer(), self.sampling.n,
                                              self.episodes.sampler(self), self.weights.version())
        tokens = sum(r.trained_tokens for r in rollouts)
        self._generated_total += tokens
        return GenerationResult(rollouts, GenerationSummary(
            len(rollouts), tuple(skipped), tokens, time.perf_counter() - t0, self.weights.version(),
            self._incomplete_kept_sets - incomplete, tuple(sorted(counts.items()))))

    def sample_turns(self, transcripts: list[list[int]], room: list[int], keys: list[tuple[int, int, int]]) -> list:
        """One round of multi-turn episodes (actors/environments/episodes.py): each transcript's exact ids
        continued by one turn of at most its ``room`` tokens, ending at EOS; each turn seeded by
        (seed, version, its key: prompt index, sample index, turn). -> one episodes.Turn each,
        with the version that sampled each token (with partial rollouts a push may land between
        two engine steps of the round, as in ``generate``)."""
        from vllm.inputs import TokensPrompt

        s = self.sampling
        kept_set.check_vocab(s.top_k, s.top_p, self._vocab_size, self.name)
        if self.partial_rollouts:
            outputs = self._step_engine([list(t) for t in transcripts], lambda: self._turn_params(room, keys))
            version = self.weights.version()  # where vLLM labelled no token (as _to_rollout reads it)
        else:
            with self._turns.sampling():  # a push waits for the round
                version = self.weights.version()
                outputs = self._llm.generate([TokensPrompt(prompt_token_ids=list(t)) for t in transcripts],
                                             self._turn_params(room, keys), use_tqdm=False,
                                             lora_request=self.weights.adapter)
        return [self._turn(out, version) for out in outputs]

    def serve_turn(self, prompt: list[int], room: int, key: tuple[int, int, int]) -> Turn:
        """One call of a gateway session (actors/gateway): ``prompt`` continued by at most ``room``
        tokens, seeded as a turn of ``sample_turns`` with ``key``, admitted into the engine while
        it runs other calls (actors/admitted_calls.py). The gateway calls it in AGENT_CALLS_GROUP."""
        out, version = self._admitted().sample(prompt, self._one_turn_params(room, key))
        return self._turn(out, version)

    def admit_turn(self, prompt: list[int], room: int, key: tuple[int, int, int], then) -> None:
        """``serve_turn`` without waiting, for episodes played at their own pace
        (actors/environments/continuous.py): ``then(Turn or the error)`` once its request ends."""
        def ended(out, version, error):
            try:
                then(error if error is not None else self._turn(out, version))
            except Exception as e:  # noqa: BLE001 - reading the output failed: the turn's error
                then(e)
        self._admitted().submit(prompt, self._one_turn_params(room, key), ended)

    def _admitted(self) -> AdmittedCalls:
        if self._calls is None:
            with self._calls_made:
                if self._calls is None:
                    self._calls = AdmittedCalls(engine=self._llm.llm_engine, turns=self._turns,
                                                adapter=lambda: self.weights.adapter,
                                                stepping=self.partial_rollouts, name=self.name,
                                                on_engine=self._llm.engine_thread.call)
        return self._calls

    def _one_turn_params(self, room: int, key: tuple[int, int, int]):
        kept_set.check_vocab(self.sampling.top_k, self.sampling.top_p, self._vocab_size, self.name)
        return lambda: (self._turn_params([room], [key])[0], self.weights.version())

    def _turn(self, out, version: int) -> Turn:
        """A finished one-completion request as a Turn; ``version`` where vLLM labelled no token."""
        s, (c,) = self.sampling, out.outputs
        ids, kept = list(c.token_ids), None
        if is_truncated(s.top_k, s.top_p):  # the kept sets, as _to_rollout reads them
            logprobs, kept, incomplete = kept_set.read_completion(
                ids, c.logprobs, kept_set.logprobs_to_read(s.top_k, self._vocab_size))
            self._incomplete_kept_sets += incomplete
        else:
            logprobs = kept_set.read_sampled(ids, c.logprobs)
        return Turn(token_ids=ids, logprobs=logprobs, kept_ids=kept, cached_tokens=int(out.num_cached_tokens or 0),
                    versions=token_versions(c.weight_versions, len(ids), version))

    def _turn_params(self, room: list[int], keys: list[tuple[int, int, int]]) -> list:
        """One SamplingParams per turn, seeded by the version now (call it holding the engine)."""
        s, version = self.sampling, self.weights.version()
        return [self._request_params(int(r), n=1, ignore_eos=False, seed=request_seed(s.seed, version, *key))
                for r, key in zip(room, keys)]

    def _step_engine(self, prompts: list[list[int]], params) -> list:
        """LLM.generate, stepping the engine here so that a weight push can take its turn
        between two steps. ``params()`` gives the requests' SamplingParams (called holding the
        engine, so their seeds come from the version they start on). Returns the finished
        RequestOutputs in prompt order."""
        from vllm.inputs import tokens_input

        engine = self._llm.llm_engine
        ids = [f"{self.name}-{next(self._request_ids)}" for _ in prompts]
        done: dict = {}
        with self._turns.stepping_call():
            try:
                with self._turns.step():  # seeds are drawn from the version the request starts on
                    for rid, prompt, p in zip(ids, prompts, params()):
                        engine.add_request(rid, tokens_input(prompt), p, lora_request=self.weights.adapter)
                while len(done) < len(ids):
                    with self._turns.step():
                        for out in engine.step():
                            if out.finished:
                                done[out.request_id] = out
            finally:
                if len(done) < len(ids):  # an error mid-call: leave nothing running in the engine
                    with self._turns.step(), contextlib.suppress(Exception):  # the first error is the one to see
                        engine.abort_request([r for r in ids if r not in done])
        return [done[r] for r in ids]

    def sample(self, prompt_ids: list, prompt_indices: list[int]) -> tuple[list[Rollout], GenerationSummary]:
        """generate(), split in two for Ray's ``num_returns=2``: the rollouts stay in the object
        store (scorers and the buffer take them by reference) and only the summary travels
        to the driver."""
        result = self.generate(prompt_ids, prompt_indices)
        return result.rollouts, result.summary

    def _to_rollout(self, prompt: list[int], prompt_index: int, completion) -> tuple[Rollout, int]:
        """The rollout of one completion, and its positions whose kept set may be incomplete."""
        token_ids = list(completion.token_ids)
        kept, incomplete, s = None, 0, self.sampling
        if is_truncated(s.top_k, s.top_p):
            logprobs, kept, incomplete = kept_set.read_completion(
                token_ids, completion.logprobs, kept_set.logprobs_to_read(s.top_k, self._vocab_size))
        else:
            logprobs = kept_set.read_sampled(token_ids, completion.logprobs)
        version = self.weights.version()
        versions = token_versions(completion.weight_versions, len(token_ids), version)
        rollout = Rollout(prompt_ids=np.asarray(prompt, dtype=np.int64),
                          response_ids=np.asarray(token_ids, dtype=np.int64),
                          behaviour_logprobs=np.asarray(logprobs, dtype=np.float32),
                          finish_reason="stop" if completion.finish_reason == "stop" else "length",
                          policy_version=int(versions[0]) if len(versions) else version,
                          prompt_index=prompt_index, sample_index=completion.index, token_versions=versions,
                          kept_ids=kept)
        return rollout, incomplete

    # ---- weight updates: core.infra.weights.WeightReceiver, received by EngineWeights (actors/weight_receiver.py).
    # Ray calls them on this actor; load_weights, rewind and a GPU transfer round run in WEIGHT_UPDATE_GROUP.
    def load_weights(self, version: int, buckets: list[bytes]) -> dict:
        return self.weights.load_weights(version, buckets)

    def load_adapter(self, version: int, files: dict[str, bytes]) -> dict:
        return self.weights.load_adapter(version, files)

    def rewind(self, version: int) -> None:
        self.weights.rewind(version)

    def version(self) -> int:
        return self.weights.version()

    def weight_transfer_gpus(self, transport: str) -> list[str]:
        return self.weights.weight_transfer_gpus(transport)

    def init_weight_transfer(self, init_info: dict) -> None:
        self.weights.init_weight_transfer(init_info)

    def start_weight_update(self, version: int) -> None:
        self.weights.start_weight_update(version)

    def update_weights(self, update_info: dict) -> None:
        self.weights.update_weights(update_info)

    def finish_weight_update(self, version: int) -> dict:
        return self.weights.finish_weight_update(version)

    def shutdown_weight_transfer(self) -> None:
        self.weights.shutdown_weight_transfer()

    def health(self) -> dict:
        return {"name": self.name, "pid": os.getpid(), "version": self.weights.version(),
                "skipped_prompts": self._skipped_total, "generated_tokens": self._generated_total,
                "engine_start_s": self.start_seconds, "pushes_mid_generate": self._turns.updates_during_sampling,
                "incomplete_kept_sets": self._incomplete_kept_sets,
                "dtype": str(self._llm.llm_engine.model_config.dtype).removeprefix("torch."),
                **({} if self.episodes is None else {"env": self.episodes.workers.stats()})}


def _has_cuda() -> bool:
    try:
        import torch
        return torch.cuda.is_available()
    except ImportError:
        return False
