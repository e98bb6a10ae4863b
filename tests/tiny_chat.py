"""Tiny random-weight chat models for the tool-calling tests: the real SmolLM2 tokenizer
(vocabulary 49152, from the embedded GGUF) with a chat template of one of the two tool-call
families, written here for these tests (not the vendors' text):

- ``"qwen"``: Qwen2.5's layout: ChatML turns, the tools in the system turn between
  ``<tools></tools>``, calls as ``<tool_call>`` JSON, results as ``<tool_response>`` blocks
  in a user turn. Its tool format is HERMES.
- ``"llama"``: Llama 3.1's layout: ``<|start_header_id|>role<|end_header_id|>`` headers and
  ``<|eot_id|>`` ends, the tools as JSON in the system turn with an instruction to answer
  ``{"name": ..., "parameters": ...}``, calls written so, results in an ``ipython`` turn.
  Its tool format is LLAMA3_JSON. SmolLM2's vocabulary has none of Llama's special
  tokens, so the markup is plain text here (the format is what these tests are about); the
  turn still ends with SmolLM2's end token.
- ``"qwen3"``: a reasoning model's: the ``"qwen"`` layout, whose generation prompt opens
  the thinking (``<think>\n``, as QwQ's and DeepSeek-R1's do) unless ``enable_thinking``
  is false, which closes it empty (``<think>\n\n</think>\n\n``, as Qwen3's does); an
  assistant's earlier reasoning is left out. ``<think>`` and ``</think>`` are added to the
  vocabulary as tokens that are not special (ids 49152 and 49153), as Qwen3's has them.
  Its architecture is Qwen3's.

With ``marker_tokens``, ``<tool_call>`` and ``</tool_call>`` are added to the vocabulary as
special tokens (ids 49152 and 49153), as Qwen2.5's vocabulary has them (ids 151657 and
151658): the forced-call grammar must then name them as tokens, and the detokenizer keep
them in the text.

The weights are random, so what the model says must be forced (logit bias, grammar) by
the tests that use it.
"""

from __future__ import annotations

import shutil
from pathlib import Path

QWEN_STYLE_TEMPLATE = r"""
{%- set ns = namespace(start=0) -%}
{%- if messages and messages[0].role == 'system' %}{% set ns.start = 1 %}{% endif -%}
{%- if tools -%}
  {{- '<|im_start|>system\n' -}}
  {%- if ns.start %}{{- messages[0].content + '\n\n' -}}{% endif -%}
  {{- 'Functions you may call, one JSON schema per line:\n<tools>\n' -}}
  {%- for tool in tools %}{{- tool | tojson + '\n' -}}{% endfor -%}
  {{- '</tools>\nTo call a function, answer with one block per call:\n<tool_call>\n'
      + '{"name": "<function name>", "arguments": <the arguments as a JSON object>}\n</tool_call><|im_end|>\n' -}}
{%- elif ns.start -%}
  {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' -}}
{%- endif -%}
{%- for message in messages[ns.start:] -%}
  {%- if message.role == 'tool' -%}
    {%- if loop.first or loop.previtem.role != 'tool' %}{{- '<|im_start|>user' -}}{% endif -%}
    {{- '\n<tool_response>\n' + message.content + '\n</tool_response>' -}}
    {%- if loop.last or loop.nextitem.role != 'tool' %}{{- '<|im_end|>\n' -}}{% endif -%}
  {%- elif message.role == 'assistant' -%}
    {{- '<|im_start|>assistant' -}}
    {%- if message.content %}{{- '\n' + message.content -}}{% endif -%}
    {%- for call in message.tool_calls or [] -%}
      {{- '\n<tool_call>\n{"name": ' + call.function.name | tojson + ', "arguments": '
          + call.function.arguments | tojson + '}\n</tool_call>' -}}
    {%- endfor -%}
    {{- '<|im_end|>\n' -}}
  {%- else -%}
    {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' -}}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' -}}{% endif -%}
"""

LLAMA_STYLE_TEMPLATE = r"""
{%- set ns = namespace(start=0, system='') -%}
{%- if messages and messages[0].role == 'system' -%}
  {%- set ns.start = 1 %}{% set ns.system = messages[0].content -%}
{%- endif -%}
{{- '<|start_header_id|>system<|end_header_id|>\n\n' + ns.system -}}
{%- if tools -%}
  {%- if ns.system %}{{- '\n\n' -}}{% endif -%}
  {{- 'You may call the functions below. To call one, reply with nothing but a JSON object '
      + '{"name": function name, "parameters": object of argument names and values}.\n\n' -}}
  {%- for tool in tools %}{{- tool | tojson + '\n' -}}{% endfor -%}
{%- endif -%}
{{- '<|eot_id|>' -}}
{%- for message in messages[ns.start:] -%}
  {%- if message.role == 'assistant' and message.tool_calls -%}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
    {%- for call in message.tool_calls -%}
      {%- if not loop.first %}{{- '; ' -}}{% endif -%}
      {{- '{"name": ' + call.function.name | tojson + ', "parameters": ' + call.function.arguments | tojson + '}' -}}
    {%- endfor -%}
    {{- '<|eot_id|>' -}}
  {%- elif message.role == 'tool' -%}
    {{- '<|start_header_id|>ipython<|end_header_id|>\n\n' + message.content + '<|eot_id|>' -}}
  {%- else -%}
    {{- '<|start_header_id|>' + message.role + '<|end_header_id|>\n\n' + message.content + '<|eot_id|>' -}}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}{% endif -%}
"""

QWEN3_STYLE_TEMPLATE = QWEN_STYLE_TEMPLATE.replace(
    "{%- if message.content %}{{- '\\n' + message.content -}}{% endif -%}",
    "{%- if message.content %}{{- '\\n' + message.content.split('</think>')[-1].lstrip() -}}{% endif -%}",
).replace(
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' -}}{% endif -%}",
    "{%- if add_generation_prompt -%}\n  {{- '<|im_start|>assistant\\n' -}}\n"
    "  {%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' -}}\n"
    "  {%- else %}{{- '<think>\\n' -}}{% endif -%}\n{%- endif -%}",
)

TEMPLATES = {"qwen": QWEN_STYLE_TEMPLATE, "llama": LLAMA_STYLE_TEMPLATE, "qwen3": QWEN3_STYLE_TEMPLATE}


END_OF_TURN = 2
"""SmolLM2's ``<|im_end|>``, the end of a turn in both templates here."""
SAYS_WORD = ("Atlantic", 33960)
"""A word that is one token of SmolLM2's vocabulary, and unlikely in a client's own output:
what a ``says`` model (:func:`write_tiny_chat_model`) answers."""
MARKER_TOKENS = {"<tool_call>": 49152, "</tool_call>": 49153}
"""The ids of the call markers a ``marker_tokens`` tokenizer adds to SmolLM2's 49152."""
THINK_TOKENS = {"<think>": 49152, "</think>": 49153}
"""The ids of the thinking markers the ``"qwen3"`` style's tokenizer adds to SmolLM2's 49152."""


def write_chat_tokenizer(directory: Path, style: str, marker_tokens: bool = False) -> Path:
    """Write SmolLM2's tokenizer files with the ``style`` template ("qwen" or "llama")
    into ``directory`` (created), with :data:`MARKER_TOKENS` added as special tokens where
    ``marker_tokens``; returns it."""
    from shardline.models.store import DEFAULT_MODEL_ID, ModelStore

    directory = Path(directory)
    # The embedded model's tokenizer files, saved from its GGUF once per machine (the
    # conversion takes ~13 s); the store argument is not used for the default model.
    source = ModelStore(directory / "unused-store").tokenizer_path(DEFAULT_MODEL_ID)
    shutil.copytree(source, directory, dirs_exist_ok=True)
    if style == "qwen3":
        from tokenizers import AddedToken
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(directory))
        tokenizer.add_tokens([AddedToken(text, special=False, normalized=False) for text in THINK_TOKENS])
        assert tokenizer.convert_tokens_to_ids(list(THINK_TOKENS)) == list(THINK_TOKENS.values())
        tokenizer.save_pretrained(str(directory))
    if marker_tokens:
        from tokenizers import AddedToken
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(directory))
        tokenizer.add_tokens(
            [AddedToken(text, special=True, normalized=False) for text in MARKER_TOKENS], special_tokens=True
        )
        assert tokenizer.convert_tokens_to_ids(list(MARKER_TOKENS)) == list(MARKER_TOKENS.values())
        tokenizer.save_pretrained(str(directory))
    (directory / "chat_template.jinja").write_text(TEMPLATES[style])
    return directory


def write_tiny_chat_model(
    directory: Path,
    style: str,
    *,
    layers: int = 2,
    seed: int = 0,
    marker_tokens: bool = False,
    context: int = 4096,
    ends_at_once: bool = False,
    says: tuple[int, ...] = (),
) -> Path:
    """A tiny random-weight model directory (safetensors, float32, hidden size 64, tied
    embeddings, trained context ``context``) with SmolLM2's tokenizer (with the call
    markers as special tokens where ``marker_tokens``: :func:`write_chat_tokenizer`) and
    the ``style`` chat template: Qwen2 architecture for "qwen", Qwen3 for "qwen3" (which
    takes no ``marker_tokens``: its thinking markers have those ids), Llama for "llama".
    Takes a few seconds.

    ``ends_at_once``: untied embeddings set so that the end of turn (``<|im_end|>``, id 2)
    outweighs every other token by ~30 logits whatever the context, so an answer ends at
    once at any temperature up to 2 and any ``max_tokens`` (what a replay of a client's
    request with ``max_tokens`` 32000 needs): every token's embedding carries 200 in
    dimension 0, which the layers' small outputs leave the largest part of the residual,
    and only the end token's head row reads that dimension.

    ``says``: token ids, all different (e.g. :data:`SAYS_WORD`'s one), with the same untied
    layout: the model answers them in order, then ends the turn, at any temperature up to
    2. Dimension 0 (200 in every embedding) makes the first win after any token not among
    them; the k-th one's embedding also carries 200 in dimension 1 + k, which makes the
    next one (the end token after the last) win after it by ~100 logits."""
    import torch
    import transformers
    from tiny_models import randomize, save_hf

    if style not in TEMPLATES:
        raise ValueError(f"style must be one of {sorted(TEMPLATES)}, got {style!r}")
    if style == "qwen3" and marker_tokens:
        raise ValueError("the qwen3 style's thinking markers take the ids marker_tokens would add")
    transformers.logging.set_verbosity_error()
    added = (len(MARKER_TOKENS) if marker_tokens else 0) + (len(THINK_TOKENS) if style == "qwen3" else 0)
    kwargs = dict(
        vocab_size=49152 + added,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=context,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=not (ends_at_once or says),
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    if style == "qwen":
        config = transformers.Qwen2Config(use_sliding_window=False, **kwargs)
        model = transformers.Qwen2ForCausalLM(config)
    elif style == "qwen3":
        config = transformers.Qwen3Config(head_dim=16, use_sliding_window=False, **kwargs)
        model = transformers.Qwen3ForCausalLM(config)
    else:
        config = transformers.LlamaConfig(**kwargs)
        model = transformers.LlamaForCausalLM(config)
    torch.manual_seed(seed)
    model = model.to(torch.float32).eval()
    randomize(model, seed)
    if ends_at_once:
        with torch.no_grad():
            model.model.embed_tokens.weight[:, 0] = 200.0
            model.model.norm.weight[0] = 1.0
            model.lm_head.weight[:, 0] = 0.0
            model.lm_head.weight[END_OF_TURN, 0] = 4.0
    if says:
        if len(set(says)) != len(says) or len(says) > kwargs["hidden_size"] - 1:
            raise ValueError(f"says: up to {kwargs['hidden_size'] - 1} different tokens, got {says}")
        with torch.no_grad():
            model.model.embed_tokens.weight[:, : len(says) + 1] = 0.0
            model.model.embed_tokens.weight[:, 0] = 200.0
            model.model.norm.weight[: len(says) + 1] = 1.0
            model.lm_head.weight[:, : len(says) + 1] = 0.0
            model.lm_head.weight[says[0], 0] = 10.0
            for k, token in enumerate(says):
                model.model.embed_tokens.weight[token, 1 + k] = 200.0
                model.lm_head.weight[says[0], 1 + k] = -20.0
                model.lm_head.weight[(*says[1:], END_OF_TURN)[k], 1 + k] = 20.0
    save_hf(model, Path(directory))
    return write_chat_tokenizer(Path(directory), style, marker_tokens)  # its generation_config.json: the end tokens
