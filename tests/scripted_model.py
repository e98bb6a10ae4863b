"""A tiny hand-set model that runs one tool task: on its first turn it writes a given tool
call, and once a tool result is in the prompt it answers a given text; each ends the turn.

What a coding agent's live test needs (tests/test_agents_live_e2e.py): the agent sends its
request with its tools (``tool_choice: auto``), the model calls the agent's own tool
(Claude Code's ``Write``, opencode's ``write``, Codex's ``exec_command``) with arguments the
test chose, the agent runs the tool and sends the result back, the model answers plain
text and the agent exits. The random-weight ``says`` models of tests/tiny_chat.py cannot:
they map the last token to the next one, so they can neither write text that repeats a
token (every JSON call does: ``":``, ``_``, ``/``) nor answer differently after a tool
result (an agent would call the tool until its own limit).

No weight here is trained or random: each is set so that the model computes

    next token = TABLE[phase][the last m tokens]

where ``phase`` is whether a ``<tool_response>`` token is anywhere in the prompt, and the
table holds, for each phase, the script (the call, or the answer) as contexts: the
generation prompt's last tokens and the script's tokens so far, each context just long
enough (``m``, 1 to :data:`MAX_ORDER` tokens) to tell the next token apart from the others
of its script (:func:`script_rules`). Anything else (a prompt that does not end with the
generation prompt) is answered with the end of the turn at once.

The model is Qwen2's architecture, one layer, written as bfloat16 safetensors (~50 MB, most
of it the embedding and the LM head over the 49,156-token vocabulary) with the real
SmolLM2 tokenizer and tests/tiny_chat.py's ``"qwen"`` chat template, so shardline serves it
as any Qwen2 checkpoint (in bfloat16, which the margins below allow for). The tokenizer has
Qwen2.5's tool markers as single tokens: ``<tool_call>`` and ``</tool_call>`` special
(ids 49152, 49153: :data:`tiny_chat.MARKER_TOKENS`, so the output keeps them and
shardline's parser reads the call as Qwen2.5's), ``<tool_response>`` and
``</tool_response>`` not special (49154, 49155: :data:`RESPONSE_TOKENS`).

How the weights compute it. The residual stream has a constant in dimension 0, the phase
in dimension 1, then ``order`` blocks of ``S`` dimensions, one a slot: a slot for each
token the scripts and the generation prompt use, one for ``<tool_response>``, one for
every other token. Block 0 holds the current token's slot, block ``d`` the slot of the
token ``d`` places back. Heads are 64 dimensions wide (128 where ``S`` is over 64).

- Embedding: every token has :data:`C` in dimension 0 and 1 in its slot of block 0, so
  every embedding has the same norm, which the first norm's weights undo.
- Attention, heads ``d = 1 .. order-1`` (previous-token heads): the query and key are
  constants (Qwen2's q and k biases; their weights are 0), so the score depends on the
  distance alone, through RoPE. In the fastest :data:`ROPE_SHARE` of the frequency pairs
  the key is 1 and the query ``LAMBDA * exp(-i d theta_j)`` (as complex numbers), so the
  score at distance ``delta`` is ``LAMBDA / sqrt(head_dim) * sum_j cos(theta_j (delta -
  d))``: highest at ``delta = d``, by at least :data:`NEAR_GAP` over ``d +- 1`` and
  :data:`FAR_GAP` over any distance 3 or more from ``d``, up to :data:`MAX_DISTANCE`
  (checked at build, :func:`_rope_gaps`; ``rope_theta`` 1e6, Qwen2.5's). Its value is
  the token's slot, written into block ``d``.
- Attention, head ``order-1`` (the phase): its key is :data:`FLAG_SCORE` for
  ``<tool_response>`` and 0 for any other token, in the slowest frequency pair (which
  turns by about 0.1 radian over 65,536 positions), the query a constant there. Where the
  prompt holds that token the head attends to it (a score of 30 against 0: e^-30 for each
  other token) and writes its value, 1, into dimension 1; elsewhere it writes 0.
- MLP (SwiGLU, a unit per table entry): ``up`` reads dimension 0 (1 everywhere);
  ``gate`` is ``BETA * (matches - (m - 1/2))``, ``matches`` being the entry's ``m``
  token slots read in blocks ``0 .. m-1`` plus its phase term (``-2 x phase`` for the
  first answer, ``phase - 1`` for the one after a result). Its silu is ``BETA/2`` where
  everything matches and ~0 where one thing does not (silu(-20) ~ -4e-8); ``down``
  writes :data:`OUT` into block 0 at the next token's slot.
- LM head: each slot's token reads its slot in block 0 (:data:`W_TOKEN`); the end of turn
  also reads dimension 0 (:data:`W_END`), so it wins where no entry fires (logit ~31
  against ~6 for the current token and 0 for the rest of the vocabulary) and loses by
  ~40 where one does (~57 against ~14): the same answer at any temperature up to 2.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

RESPONSE_TOKENS = {"<tool_response>": 49154, "</tool_response>": 49155}
"""The tool-result markers added (not special) after :data:`tiny_chat.MARKER_TOKENS`, as
Qwen2.5's vocabulary has them (ids 151665 and 151666)."""
GENERATION_PROMPT = "<|im_start|>assistant\n"
"""What the ``"qwen"`` template ends a prompt with: where a script starts."""
END_OF_TURN = 2
MAX_ORDER = 8
"""The longest context an entry may need (previous-token heads: one fewer)."""
HEAD_DIMS = (64, 128)
"""A head's width: the smallest that holds the slots (a previous-token head's value is a
slot, one dimension each)."""
ROPE_THETA = 1e6
ROPE_SHARE = 0.75
"""The share of a head's frequency pairs the previous-token heads use: the fast ones
(``theta_i`` from 1 down to ~5e-5), which turn over the distances a prompt has; the slow
rest would only raise the peak without parting it from its neighbours."""
LAMBDA = 80.0
NEAR_GAP = 7.0
FAR_GAP = 40.0
MAX_DISTANCE = 131072
FLAG_SCORE = 30.0
C = 10.0
BETA = 40.0
OUT = 20.0
W_TOKEN = 4.0
W_END = 2.0


def tool_call_text(name: str, arguments: dict[str, Any]) -> str:
    """A call of ``name`` with ``arguments`` as the ``"qwen"`` template writes one in an
    assistant turn (and Qwen2.5 writes it)."""
    return f'<tool_call>\n{{"name": {json.dumps(name)}, "arguments": {json.dumps(arguments)}}}\n</tool_call>'


@dataclass(frozen=True)
class Rule:
    """One table entry: where the last ``len(context)`` tokens are ``context`` (the last
    one first) and the phase is ``after_result``, the next token is ``token``."""

    context: tuple[int, ...]
    after_result: bool
    token: int


def script_rules(prompt_end: list[int], script: list[int], after_result: bool) -> list[Rule]:
    """The entries that make a model write ``script`` (its tokens, the end of turn last)
    after a prompt ending with ``prompt_end``: for each token, the shortest context of
    the tokens before it that no other position of the script, with another next token,
    shares.

    Raises:
        ValueError: a token that needs more than :data:`MAX_ORDER` tokens of context.
    """
    seq = [*prompt_end, *script]
    first = len(prompt_end) - 1  # the positions whose next token the model writes
    rules = []
    for k in range(first, len(seq) - 1):
        for m in range(1, min(MAX_ORDER, k + 1) + 1):
            context = tuple(seq[k - m + 1 : k + 1])
            clash = [
                j
                for j in range(first, len(seq) - 1)
                if seq[j + 1] != seq[k + 1] and j - m + 1 >= 0 and tuple(seq[j - m + 1 : j + 1]) == context
            ]
            if not clash:
                rules.append(Rule(context[::-1], after_result, seq[k + 1]))
                break
        else:
            raise ValueError(f"token {k + 1 - len(prompt_end)} of the script needs a context longer than {MAX_ORDER}")
    return rules


def _rope_gaps(theta: list[float], head_dim: int, d: int) -> tuple[float, float]:
    """A previous-token head's score at distance ``d`` less its largest elsewhere: within
    one of ``d``, and at 3 or more from it (up to :data:`MAX_DISTANCE`)."""
    import numpy as np

    delta = np.arange(0, MAX_DISTANCE + 1)
    score = LAMBDA / math.sqrt(head_dim) * np.cos(np.outer(delta - d, np.array(theta))).sum(1)
    near = score[d] - max(score[d - 1], score[d + 1])
    far = score[d] - np.delete(score, range(max(0, d - 2), d + 3)).max()
    return float(near), float(far)


def write_scripted_tokenizer(directory: Path) -> Path:
    """SmolLM2's tokenizer with the ``"qwen"`` template, the call markers as special tokens
    and :data:`RESPONSE_TOKENS` added, into ``directory``."""
    from tiny_chat import write_chat_tokenizer
    from tokenizers import AddedToken
    from transformers import AutoTokenizer

    write_chat_tokenizer(directory, "qwen", marker_tokens=True)
    tokenizer = AutoTokenizer.from_pretrained(str(directory))
    tokenizer.add_tokens([AddedToken(text, special=False, normalized=False) for text in RESPONSE_TOKENS])
    assert tokenizer.convert_tokens_to_ids(list(RESPONSE_TOKENS)) == list(RESPONSE_TOKENS.values())
    tokenizer.save_pretrained(str(directory))
    return directory


def write_scripted_model(directory: Path, first: str, after_result: str = "Done.", *, context: int = 32768) -> Path:
    """A model directory (see the module docstring) that answers ``first`` (text: a call
    from :func:`tool_call_text`, or any other) while no tool result is in the prompt and
    ``after_result`` once one is, each followed by the end of the turn; its trained
    context is ``context``. Takes a few seconds.

    Raises:
        ValueError: a script that needs more than :data:`MAX_ORDER` tokens of context, or
            scripts of more than 126 different tokens (with the generation prompt's).
    """
    import torch
    import transformers
    from tiny_models import save_hf

    directory = Path(directory)
    write_scripted_tokenizer(directory)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(directory))
    prompt_end = tokenizer.encode(GENERATION_PROMPT, add_special_tokens=False)
    scripts = {
        False: [*tokenizer.encode(first, add_special_tokens=False), END_OF_TURN],
        True: [*tokenizer.encode(after_result, add_special_tokens=False), END_OF_TURN],
    }
    rules = [rule for phase, script in scripts.items() for rule in script_rules(prompt_end, script, phase)]
    marker = RESPONSE_TOKENS["<tool_response>"]
    used = sorted({*prompt_end, *scripts[False], *scripts[True], marker})
    slot = {token: i for i, token in enumerate(used)}
    other = len(used)
    slots = other + 1
    head_dim = next((n for n in HEAD_DIMS if slots <= n), None)
    if head_dim is None:
        raise ValueError(
            f"the scripts use {len(used) - 1} different tokens with the generation prompt's, "
            f"more than {HEAD_DIMS[-1] - 2}"
        )
    order = max(len(rule.context) for rule in rules)  # blocks: the current token, then d = 1 .. order-1
    heads = max(order, math.ceil((2 + order * slots) / head_dim))
    hidden = heads * head_dim
    flag_head = order - 1
    units = 16 * math.ceil(len(rules) / 16)
    vocab = 49152 + 2 + len(RESPONSE_TOKENS)

    def block(d: int) -> int:
        return 2 + d * slots

    transformers.logging.set_verbosity_error()
    config = transformers.Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=units,
        num_hidden_layers=1,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=context,
        rms_norm_eps=1e-6,
        rope_theta=ROPE_THETA,
        tie_word_embeddings=False,
        use_sliding_window=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    model = transformers.Qwen2ForCausalLM(config).to(torch.float32).eval()
    half = head_dim // 2
    theta = [ROPE_THETA ** (-i / half) for i in range(half)]  # RoPE's frequency of each pair
    pairs = int(half * ROPE_SHARE)
    for d in range(1, order):
        near, far = _rope_gaps(theta[:pairs], head_dim, d)
        assert near >= NEAR_GAP and far >= FAR_GAP, (d, near, far)
    low = half - 1  # the slowest pair: the phase head's
    assert FLAG_SCORE * (1 - math.cos(theta[low] * context)) < 1.0
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        embed = model.model.embed_tokens.weight
        embed[:, 0] = C
        embed[:, block(0) + other] = 1.0
        for token, s in slot.items():
            embed[token, block(0) + other] = 0.0
            embed[token, block(0) + s] = 1.0
        norm_in = math.sqrt((C * C + 1) / hidden)  # every embedding's RMS
        layer = model.model.layers[0]
        layer.input_layernorm.weight.fill_(norm_in)  # the norm leaves embeddings as they are
        attn = layer.self_attn
        for d in range(1, order):
            h = (d - 1) * head_dim
            for i in range(pairs):
                attn.q_proj.bias[h + i] = LAMBDA * math.cos(d * theta[i])
                attn.q_proj.bias[h + half + i] = -LAMBDA * math.sin(d * theta[i])
                attn.k_proj.bias[h + i] = 1.0
            for s in range(slots):
                attn.v_proj.weight[h + s, block(0) + s] = 1.0
                attn.o_proj.weight[block(d) + s, h + s] = 1.0
        h = flag_head * head_dim
        attn.q_proj.bias[h + low] = FLAG_SCORE * math.sqrt(head_dim) / 16.0
        attn.k_proj.weight[h + low, block(0) + slot[marker]] = 16.0
        attn.v_proj.weight[h, block(0) + slot[marker]] = 1.0
        attn.o_proj.weight[1, h] = 1.0
        # after attention: C, the flag, and one slot in each of `order` blocks
        layer.post_attention_layernorm.weight.fill_(math.sqrt((C * C + order) / hidden))
        mlp = layer.mlp
        for u, rule in enumerate(rules):
            m = len(rule.context)
            for d, token in enumerate(rule.context):
                mlp.gate_proj.weight[u, block(d) + slot[token]] = BETA
            if rule.after_result:
                mlp.gate_proj.weight[u, 1] = BETA
                mlp.gate_proj.weight[u, 0] = -BETA * (m + 0.5) / C
            else:
                mlp.gate_proj.weight[u, 1] = -2 * BETA
                mlp.gate_proj.weight[u, 0] = -BETA * (m - 0.5) / C
            mlp.up_proj.weight[u, 0] = 1.0 / C
            mlp.down_proj.weight[block(0) + slot[rule.token], u] = OUT / (BETA / 2)
        model.model.norm.weight.fill_(16.0 / math.sqrt(hidden))  # logits as at width 256, whatever the width
        for token, s in slot.items():
            model.lm_head.weight[token, block(0) + s] = W_TOKEN
        model.lm_head.weight[END_OF_TURN, 0] = W_END
    ends = (directory / "generation_config.json").read_text()  # the tokenizer's: the end tokens
    save_hf(model.to(torch.bfloat16), directory)
    (directory / "generation_config.json").write_text(ends)  # save_pretrained wrote its own
    return directory
