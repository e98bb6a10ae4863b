"""The scripted model of tests/scripted_model.py, in transformers (its reference): it writes
its call on a first turn and its answer once a tool result is in the prompt, by margins
that no temperature up to 2 overturns; its table takes the shortest contexts that decide."""

from __future__ import annotations

import pytest
from scripted_model import MAX_ORDER, Rule, script_rules, tool_call_text, write_scripted_model

END = 2


@pytest.mark.fast
def test_each_token_gets_the_shortest_context_that_decides_it():
    # after the prompt's [10, 11]: 20 21 20 22, then the end; 20 is followed by 21, then by 22
    rules = script_rules([10, 11], [20, 21, 20, 22, END], after_result=False)
    assert rules == [
        Rule((11,), False, 20),
        Rule((20, 11), False, 21),
        Rule((21,), False, 20),
        Rule((20, 21), False, 22),
        Rule((22,), False, END),
    ]
    assert script_rules([10, 11], [20, END], after_result=True) == [Rule((11,), True, 20), Rule((20,), True, END)]
    with pytest.raises(ValueError, match="longer than"):
        script_rules([10, 11], [20] * (MAX_ORDER + 2) + [END], after_result=False)


PATH = "/tmp/pytest-of-user/pytest-1/test_a0/project/hello.txt"
CALL = tool_call_text("Write", {"file_path": PATH, "content": "hi"})
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "Write",
            "description": "Writes a file.",
            "parameters": {
                "type": "object",
                "properties": {"file_path": {"type": "string"}, "content": {"type": "string"}},
                "required": ["file_path", "content"],
            },
        },
    }
]


@pytest.fixture(scope="module")
def scripted(tmp_path_factory):
    import torch
    import transformers

    directory = write_scripted_model(tmp_path_factory.mktemp("scripted") / "model", CALL, "Done.", context=8192)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(directory))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32).eval()
    return tokenizer, model


def _answer(scripted, messages, generation_prompt=True):
    """The greedy answer's text to ``messages`` and the smallest margin, over its tokens,
    between the chosen token's logit and the next best one's."""
    import torch

    tokenizer, model = scripted
    ids = tokenizer.apply_chat_template(
        messages, tools=TOOLS, add_generation_prompt=generation_prompt, tokenize=True, return_dict=False
    )
    prompt = torch.tensor([ids])
    with torch.no_grad():
        out = model.generate(
            prompt,
            max_new_tokens=80,
            do_sample=False,
            eos_token_id=END,
            pad_token_id=END,
            output_logits=True,
            return_dict_in_generate=True,
        )
    top = torch.cat(out.logits).topk(2, dim=-1).values
    return tokenizer.decode(out.sequences[0, prompt.shape[1] :]), float((top[:, 0] - top[:, 1]).min())


@pytest.mark.timeout(120)
def test_the_call_then_after_its_result_the_answer(scripted):
    system = "You write files. " + 'Paths look like /tmp/x/y_z.txt, {"json": "too"}. ' * 300  # ~5,000 tokens
    ask = [{"role": "system", "content": system}, {"role": "user", "content": "Create hello.txt with hi."}]
    call, margin = _answer(scripted, ask)
    assert call == CALL + "<|im_end|>" and margin > 20
    history = [
        *ask,
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"type": "function", "function": {"name": "Write", "arguments": {"file_path": PATH, "content": "hi"}}}
            ],
        },
        {"role": "tool", "content": f"File created successfully at: {PATH}"},
    ]
    answer, margin = _answer(scripted, history)
    assert answer == "Done.<|im_end|>" and margin > 20
    # the result far back (a user turn after it): still the answer
    answer, _ = _answer(scripted, [*history, {"role": "user", "content": "And now? " * 500}])
    assert answer == "Done.<|im_end|>"


def test_a_prompt_without_the_generation_prompt_is_answered_with_the_end_of_the_turn(scripted):
    answer, margin = _answer(scripted, [{"role": "user", "content": "Create hello.txt with hi."}], False)
    assert answer == "<|im_end|>" and margin > 20
