"""Messages between a node and its runner subprocesses, and the runner's launch spec.

The two talk over a socket pair with ``multiprocessing.connection.Connection`` framing
(pickled objects); the runner first receives its :class:`RunnerSpec`, then the messages
below.

node -> runner:  ``Task``; ``Cancel``; ``Shutdown``.
runner -> node:  ``Loaded`` (ready to serve); ``Tokens`` (one engine step's new tokens);
                 ``EngineStats`` (the batch changed); ``Failed`` (exiting with an error);
                 ``Heartbeat`` (every second, from its own thread: the node's watchdog).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shardline.models.config import RankShare, Sharding


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token, for one sequence.

    temperature 0, ``top_k`` 1 or ``top_p`` 0 mean greedy (argmax: :attr:`greedy`, as
    OpenAI treats ``top_p`` 0). ``top_k`` 0, ``top_p`` 1.0 and ``min_p`` 0.0
    disable those filters. ``seed`` makes sampling reproducible for this request alone.
    Every field at its default leaves the logits untouched, so greedy output is
    bit-identical to plain argmax.

    Attributes:
        min_p: keep tokens whose probability is at least ``min_p`` times the most likely
            one's (Nguyen et al., "Turning Up the Heat: Min-p Sampling", 2024).
        frequency_penalty, presence_penalty: subtracted from a token's logit per time it
            was generated, and once if it was (OpenAI's definition; generated tokens only).
        repetition_penalty: a logit of a token seen in the prompt or the output is divided
            by it when positive, multiplied when negative (Keskar et al., CTRL, 2019);
            ``repeat_last_n`` > 0 looks at the last that many tokens only.
        logit_bias: ``(token id, bias)`` pairs added to the logits before sampling.
        logprobs: None for none; k >= 0: each token's log-probability and the k most
            likely tokens' (log-softmax of the model's logits, before any of the above).
        prompt_logprobs: None for none; k >= 0: the same for every prompt token after
            the first, given the ones before it (vLLM's ``prompt_logprobs``), sent with
            the prefill's progress (:attr:`PrefillProgress.logprobs`).
        resumed: the prompt's last ``resumed`` tokens are output the request already gave
            (a stream continued on another instance after its own failed:
            :func:`shardline.node.routing.continuation`): the sampler takes up the state
            it had after them (:class:`shardline.runner.sampling.Sampler`): they count as
            generated for the penalties, a seeded generator has drawn once for each, and
            the grammar's matcher has consumed them.
        grammar: an llguidance grammar the output must match (what
            ``LLMatcher.grammar_from_json_schema`` / ``grammar_from_lark`` return: a
            ``TopLevelGrammar``'s JSON text or Lark text): tokens it forbids are masked on
            the sampling rank (constrained decoding, :mod:`shardline.runner.constraint`);
            None: unconstrained.
        draft_tokens: k > 0: speculative decoding by prompt lookup
            (:mod:`shardline.runner.speculation`), up to k drafted tokens checked a step,
            for a sequence without a grammar or log-probabilities (any other decodes a
            token a step); 0: none; None: the instance's default (:meth:`drafts`). On
            an instance with a draft model, the draft model drafts them
            (:mod:`shardline.runner.draft_model`).
        draft_p_min: a draft model's draft ends before its first guess of a lower
            probability (llama.cpp's ``speculative.p_min``); None:
            :data:`~shardline.runner.draft_model.P_MIN`. Prompt lookup ignores it.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    repeat_last_n: int = 0
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: int | None = None
    grammar: str | None = None
    prompt_logprobs: int | None = None
    resumed: int = 0
    draft_tokens: int | None = None
    draft_p_min: float | None = None

    @property
    def greedy(self) -> bool:
        """The argmax is taken: temperature 0, top-k 1 or top-p 0 leave one token."""
        return self.temperature <= 0 or self.top_k == 1 or self.top_p <= 0

    def drafts(self, default: int) -> int:
        """Tokens it may draft a step (0: it does not speculate): ``draft_tokens``, or the
        instance's ``default`` where the request named none; 0 with a grammar or
        log-probabilities (every drafted row would need its own). Greedy or sampled: each
        drafted row is sampled as decoding would sample it, one draw of the sequence's
        generator a token taken (:meth:`~shardline.runner.engine.Engine._sample`), so the
        text is the same with or without drafts."""
        if self.grammar is not None or self.logprobs is not None:
            return 0
        return default if self.draft_tokens is None else self.draft_tokens


@dataclass(frozen=True)
class TokenRequest:
    """One generation request in token ids, as a node routes it to an instance.

    Attributes:
        model_id: the model asked for (an instance of it serves the request).
        prompt: token ids of the prompt.
        max_tokens: most tokens to generate (the stop token included).
        sampling: how each next token is picked.
        stop_token_ids: generation ends after emitting one of these.
        cache_prompt: it may resume from a cached prefix of its prompt (llama.cpp's
            server's ``cache_prompt``); False: its whole prompt is prefilled.
    """

    model_id: str
    prompt: tuple[int, ...]
    max_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop_token_ids: tuple[int, ...] = ()
    cache_prompt: bool = True


@dataclass(frozen=True)
class Task:
    """One generation request, as every rank of an instance receives it.

    Attributes:
        task_id: int64, unique in the cluster; ranks take agreed tasks in task-id order.
        origin: node id that streams this task's tokens to its client.
        prompt: token ids of the prompt.
        max_tokens: most tokens to generate (the stop token included).
        stop_token_ids: generation ends after emitting one of these.
        cache_prompt: as :attr:`TokenRequest.cache_prompt`.
    """

    task_id: int
    origin: str
    prompt: tuple[int, ...]
    max_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop_token_ids: tuple[int, ...] = ()
    cache_prompt: bool = True

    @classmethod
    def of(cls, task_id: int, origin: str, request: TokenRequest) -> "Task":
        """The task every rank runs for ``request``."""
        return cls(
            task_id,
            origin,
            request.prompt,
            request.max_tokens,
            request.sampling,
            request.stop_token_ids,
            request.cache_prompt,
        )


@dataclass(frozen=True)
class Cancel:
    task_id: int


@dataclass(frozen=True)
class Shutdown:
    pass


@dataclass(frozen=True)
class Loaded:
    """The runner joined its process group and holds its shard.

    Attributes:
        layers_read: global indices of the layers whose tensors it read from the files.
        tensors_read: how many weight tensors it read.
        bytes_read: bytes of weight data it read from the files.
        param_bytes: bytes its shard's parameters take in memory.
        kv_cache_bytes: bytes its part of the KV pool holds when full.
        rss_bytes, peak_rss_bytes: its memory once loaded, and the peak while loading.
        runtime_rss_bytes: its memory before it read any weight (Python, torch, its
            process group): the runtime placement counts per rank.
        device: the device it computes on (``"cpu"``, ``"cuda:0"``, ...).
    """

    layers_read: tuple[int, ...]
    tensors_read: int
    bytes_read: int
    param_bytes: int
    kv_cache_bytes: int
    rss_bytes: int = 0
    peak_rss_bytes: int = 0
    runtime_rss_bytes: int = 0
    device: str = "cpu"


@dataclass(frozen=True)
class TokenEvent:
    """A new token for a task; ``finish_reason`` is set on its last event.

    ``token_id`` is -1 for an event that carries only an end (a cancellation).
    finish_reason: "stop" (a stop token), "length" (max_tokens or the context is full),
    "cancelled".
    ``logprob`` and ``top_logprobs`` ((token id, log-probability) pairs, most likely
    first) are set when the task's sampling asked for ``logprobs``.
    ``cached_tokens``: of its ``prompt_tokens``, those whose keys and values came from a
    cached prefix rather than its prefill (:mod:`shardline.runner.prefix_cache`);
    ``cache_written``, on its last event: the prompt tokens past those that its slot keeps
    cached once it ends.
    ``drafted``: the draft rows its sequence carried in the step that gave it (guesses
    checked beside the next token: :mod:`shardline.runner.speculation`); 0 for a plain
    decode step's token and the prefill's first. The node that streams the task times
    plain steps apart (a drafted step computes more rows and may give several tokens).
    """

    task_id: int
    token_id: int
    finish_reason: str | None = None
    prompt_tokens: int = 0
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()
    cached_tokens: int = 0
    cache_written: int = 0
    drafted: int = 0


@dataclass(frozen=True)
class PrefillProgress:
    """A task's prompt is being prefilled: ``done`` of ``total`` prompt tokens so far.

    ``logprobs``: where the task's sampling asks for ``prompt_logprobs``, one entry per
    prompt token whose log-probability the chunk just prefilled gives: ``(index in the
    prompt, log-probability given the tokens before it, top (token id, log-probability)
    pairs, most likely first)``; the entries of all a prompt's events cover indices 1 ..
    ``total - 1`` in order. ``cached``: of ``done``, the tokens a cached prefix held (not
    computed; :mod:`shardline.runner.prefix_cache`)."""

    task_id: int
    done: int
    total: int
    logprobs: tuple[tuple[int, float, tuple[tuple[int, float], ...]], ...] = ()
    cached: int = 0


@dataclass(frozen=True)
class Tokens:
    """One engine step's events for the tasks this rank streams."""

    events: tuple[TokenEvent | PrefillProgress, ...]


@dataclass(frozen=True)
class EngineStats:
    """A rank's batch after a step in which it changed.

    Attributes:
        running: task ids holding a KV-cache slot (prefilling or decoding).
        waiting: agreed task ids waiting for a slot and KV blocks, in the order they will
            start.
        held: task ids this rank holds that not every rank holds yet.
        free_slots: places of the batch no running sequence holds (``max_batch`` less the
            running; a cached prefix's slot among them where the KV cache has no more
            slots than the batch: it is evicted for a task that needs the slot).
        steps: engine steps run so far.
        free_kv_tokens: tokens of the KV pool no running sequence has reserved (those
            of cached prefixes among them).
        cached_slots, cached_tokens, cached_bytes: slots holding a cached prefix, their
            tokens, and the bytes of the pages this rank holds their keys and values in
            (whole blocks; :mod:`shardline.runner.prefix_cache`).
        prompt_tokens, reused_tokens: prompt tokens of the tasks admitted so far, and of
            those the ones taken from cached prefixes (the hit rate).
        drafted_tokens, accepted_tokens: tokens drafted by speculative decoding so far
            and checked in a step, and of those the ones taken (the acceptance rate).
    """

    running: tuple[int, ...]
    waiting: tuple[int, ...]
    held: tuple[int, ...]
    free_slots: int
    steps: int
    free_kv_tokens: int = 0
    cached_slots: int = 0
    cached_tokens: int = 0
    cached_bytes: int = 0
    prompt_tokens: int = 0
    reused_tokens: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0


@dataclass(frozen=True)
class Heartbeat:
    """The runner is alive; its memory now and at most so far (bytes: private resident
    memory, :mod:`shardline.process_memory`: the libraries' shared file pages left out)."""

    rss_bytes: int = 0
    peak_rss_bytes: int = 0


@dataclass(frozen=True)
class Failed:
    """The runner failed with ``error``; ``peer_lost``: only because another rank of its
    instance went away (a collective or send found its peer gone), not a failure of its
    own, so the coordinator names the rank that did fail."""

    error: str
    peer_lost: bool = False


@dataclass(frozen=True)
class RunnerSpec:
    """Everything a runner needs to join its instance.

    Attributes:
        instance_id: the instance this runner serves.
        node_id: the node that started it (tasks whose origin is this node are streamed).
        model_path: a .gguf file or Hugging Face directory on this machine.
        rank, world_size: this runner's place in the process group.
        sharding: "pipeline" (a layer range per rank), "tensor" (every layer, a share of
            the heads and MLP columns) or "ring" (the whole model; prompts split across
            the ranks).
        share: what it holds: its layer range (the whole model for tensor and ring) and
            under tensor sharding its heads and columns (None there: the even split of
            ``shardline.placement.tensor.tensor_shares``).
        master_addr, master_port: rank 0's TCP rendezvous for torch.distributed (its
            node's address; rank 0 listens there only).
        host: this rank's node's address; gloo's sockets bind to it, NCCL's to the
            interface that holds it (None: the backend's own choice, the address the
            machine's hostname resolves to, often 127.0.1.1);
            :mod:`shardline.runner.rendezvous`.
        device: its node's ``--device`` (``shardline.node.profile.DEVICE_RE``: "auto",
            "cpu", "cuda[:N]", "mps"), resolved by the runner; the backend is gloo on
            CPU, NCCL on CUDA.
        collectives_on_cpu: gloo through host memory even on CUDA: ranks on one GPU,
            which NCCL refuses (``rendezvous.ranks_share_a_gpu``), of any sharding.
        dtype: compute dtype name ("bfloat16", "float16", "float32").
        quantize: "int8" or "int4" to quantize the weights the files hold in 16 or 32
            bits on load (:mod:`shardline.models.quantize`), or None.
        max_batch: most sequences decoding together (KV-cache slots).
        context: most tokens per sequence (prompt + generated).
        kv_tokens: tokens the KV pool holds, all sequences together (0: ``max_batch`` x
            ``context``); a sequence is admitted when the pool has its prompt plus its
            ``max_tokens`` (at most ``context``) in whole blocks.
        prefill_chunk: prompt tokens per prefill micro-batch.
        prefill_step_tokens: most prompt tokens prefilled per engine step while other
            sequences decode: llama.cpp's default ``n_batch`` (and vLLM's token budget a
            step). With 512, the seven 128-token prompts that arrived while an eighth
            decoded took two steps instead of one (a 3-node pipeline of the MoE bench
            model: TTFT 1.5 / 2.6 s where one step gave all seven 2.4 s, aggregate
            decode 71 -> 84 tokens/s); a decoding sequence's next token waits for them.
        prefill_burst_tokens: most prompt tokens prefilled per engine step while none
            does.
        collective_timeout_s: seconds before a collective fails (torch.distributed's
            own timeout, a backstop behind the progress watchdog).
        progress_timeout_s: seconds a rank may wait inside a step without progress (a
            transfer, a collective or a micro-batch completing) before it fails the
            instance.
        threads: torch intra-op threads (0: torch's default).
        prefix_cache: a finished sequence's slot keeps its prompt's keys and values for
            later prompts that start the same (:mod:`shardline.runner.prefix_cache`).
        model_drafts: the instance has a draft model (:mod:`shardline.runner.draft_model`):
            its sequences' drafts come from the sampling rank's, not from prompt lookup.
        draft_model_path: on the sampling rank of such an instance, the draft model's
            weights on this machine (a .gguf file or Hugging Face directory of the same
            tokenizer); None elsewhere.
    """

    instance_id: str
    node_id: str
    model_path: str
    rank: int
    world_size: int
    share: RankShare
    master_addr: str
    master_port: int
    sharding: Sharding = Sharding.PIPELINE
    host: str | None = None
    device: str = "cpu"
    collectives_on_cpu: bool = False
    dtype: str = "bfloat16"
    quantize: str | None = None
    max_batch: int = 8
    context: int = 4096
    kv_tokens: int = 0
    prefill_chunk: int = 512
    prefill_step_tokens: int = 2048
    prefill_burst_tokens: int = 4096
    collective_timeout_s: float = 120.0
    progress_timeout_s: float = 60.0
    threads: int = 0
    prefix_cache: bool = True
    model_drafts: bool = False
    draft_model_path: str | None = None
