"""Messages -> prompt ids has one owner (Tokenizer.encode_chat): with a tokenizer whose
post-processor adds a BOS and a template that writes one, the server, the CLI and LLM all send
the same ids, with one BOS."""

from __future__ import annotations

import json
import shutil

import pytest

from qrun.batch_requests import BatchDefaults, prepare_request
from qrun.errors import RequestError
from qrun.llm import LLM
from qrun.sampling_params import SamplingParams
from qrun.tokenizer import chat_messages

pytest.importorskip("uvicorn")
from test_server import live_server, request  # noqa: E402

from qrun.async_llm import AsyncLLM  # noqa: E402
from qrun.server import build_app  # noqa: E402

BOS_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
MESSAGES = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi there"}]
ENGINE = dict(device="cpu", dtype="float32", kv_cache_memory=2_000_000, max_num_seqs=4, max_num_batched_tokens=256)


@pytest.fixture(scope="module")
def bos_model(tiny_llama_dir, tmp_path_factory):
    """The tiny llama, its tokenizer given a "<s>" BOS that its post-processor adds (as Llama's do)."""
    folder = tmp_path_factory.mktemp("bos") / "model"
    shutil.copytree(tiny_llama_dir, folder)
    from tokenizers import AddedToken, Tokenizer, processors

    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tok.add_special_tokens([AddedToken("<s>", special=True)])
    bos_id = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos_id)])
    tok.save(str(folder / "tokenizer.json"))
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.update(bos_token="<s>", chat_template=BOS_TEMPLATE)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder, bos_id


def test_chat_prompts_carry_one_bos_from_llm_cli_and_server(bos_model):
    folder, bos_id = bos_model
    llm = LLM(str(folder), **ENGINE)
    ids = llm.tokenizer.encode_chat(MESSAGES)
    assert ids[0] == bos_id and ids.count(bos_id) == 1
    assert llm.tokenizer.encode("plain text")[0] == bos_id  # the post-processor is really there

    cli_ids, _ = prepare_request(llm, {"messages": MESSAGES, "max_tokens": 4}, BatchDefaults())
    assert cli_ids == ids
    assert llm.chat(MESSAGES, SamplingParams(max_tokens=1), progress=False)[0].prompt_token_ids == ids

    engine = AsyncLLM(str(folder), **ENGINE)
    try:
        with live_server(build_app(engine, model_name="tiny")) as url:
            status, _, body = request(url, "/v1/chat/completions",
                                      {"model": "tiny", "messages": MESSAGES, "max_tokens": 2, "temperature": 0})
    finally:
        engine.shutdown()
    assert status == 200 and body["usage"]["prompt_tokens"] == len(ids)


def test_llm_chat_answers_each_conversation_in_order_as_generate_does_its_prompt(bos_model):
    folder, _ = bos_model
    llm = LLM(str(folder), **ENGINE)
    conversations = [MESSAGES, [{"role": "user", "content": "Count to three."}], MESSAGES[1:]]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    replies = llm.chat(conversations, params, progress=False)
    expected = llm.generate([llm.tokenizer.encode_chat(c) for c in conversations], params, progress=False)
    assert [r.prompt_token_ids for r in replies] == [e.prompt_token_ids for e in expected]
    assert [r.token_ids for r in replies] == [e.token_ids for e in expected]
    # the conversation's template can be another, as in `qrun chat --template`
    other = llm.chat(MESSAGES, params, chat_template="{% for m in messages %}{{ m['content'] }}\n{% endfor %}",
                     progress=False)
    assert other[0].prompt_token_ids == llm.tokenizer.encode("Be terse.\nHi there\n", add_special_tokens=False)
    with pytest.raises(RequestError, match=r"^conversation 1: messages\[0\].content: "):
        llm.chat([MESSAGES, [{"role": "user", "content": 3}]], params, progress=False)
    assert not llm.engine.has_unfinished_requests()


def test_chat_templates_render_in_a_sandbox_and_their_errors_are_one_line(bos_model):
    from datetime import datetime

    from qrun.errors import QrunError
    from qrun.tokenizer import Tokenizer

    folder, _ = bos_model
    tokenizer = Tokenizer.from_folder(folder, [0])
    first = tokenizer.apply_chat_template(MESSAGES)
    assert tokenizer.apply_chat_template(MESSAGES) == first  # compiled once, rendered again
    assert tokenizer.apply_chat_template(MESSAGES, template="{{ strftime_now('%Y') }}") == str(datetime.now().year)
    refusing = "{% if messages[0]['role'] == 'system' %}{{ raise_exception('no system role here') }}{% endif %}"
    for template, message in [(refusing, "no system role here"), ("{% for m in messages %}", "Unexpected end"),
                              ("{{ messages.append(1) }}", "unsafe"), ("{{ messages.__class__.__mro__ }}", "unsafe")]:
        with pytest.raises(QrunError, match=f"^the chat template rejected the conversation: .*{message}"):
            tokenizer.apply_chat_template(MESSAGES, template=template)
    assert MESSAGES == [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi there"}]


@pytest.mark.parametrize("messages, field", [
    ([], "messages"), ("hi", "messages"), ([{"content": "x"}], "messages[0]"),
    ([{"role": "user", "content": 3}], "messages[0].content"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], "messages[0].content"),
])
def test_bad_messages_name_the_field_at_fault(messages, field):
    with pytest.raises(ValueError) as err:
        chat_messages(messages)
    assert str(err.value).startswith(f"{field}: ")


def test_message_content_parts_are_joined_and_null_is_empty():
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    assert chat_messages([{"role": "user", "content": parts}, {"role": "assistant", "content": None}]) == [
        {"role": "user", "content": "ab"}, {"role": "assistant", "content": ""}]
