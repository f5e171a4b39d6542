"""Incremental detokenization, stop strings and stop tokens."""

from __future__ import annotations

from transformers import AutoTokenizer

from lightllm.common.sampling import SamplingParams
from lightllm.server.detokenization.incremental_decoder import IncrementalDecoder, request_decoder


def _pieces(tokenizer, ids, stops=()):
    decoder = IncrementalDecoder(tokenizer, [1], stops)
    pieces = [decoder.add(t) for t in ids]
    return pieces, decoder


def test_pieces_concatenate_to_the_full_decode(tiny_llama_dir):
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_llama_dir))
    text = "Schedulers décident: café, naïve 😀 emoji and   spaces\nnew line"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    pieces, decoder = _pieces(tokenizer, ids)
    joined = "".join(pieces) + decoder.flush()
    assert joined == tokenizer.decode(ids, skip_special_tokens=True)
    assert all("\ufffd" not in p for p in pieces)


def test_stop_string_cuts_text_and_holds_back_partial_matches(tiny_llama_dir):
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_llama_dir))
    ids = tokenizer("alpha beta STOP gamma", add_special_tokens=False)["input_ids"]
    pieces, decoder = _pieces(tokenizer, ids, ["STOP"])
    assert decoder.stopped
    assert "".join(pieces) == "alpha beta "
    assert decoder.add(ids[-1]) == "" and decoder.flush() == ""


def test_partial_stop_is_released_when_it_does_not_complete(tiny_llama_dir):
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_llama_dir))
    ids = tokenizer("one STO two", add_special_tokens=False)["input_ids"]
    pieces, decoder = _pieces(tokenizer, ids, ["STOP"])
    assert not decoder.stopped
    assert "".join(pieces) + decoder.flush() == "one STO two"


def test_include_stop_str_keeps_the_stop_string(tiny_llama_dir):
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_llama_dir))
    ids = tokenizer("alpha beta STOP gamma", add_special_tokens=False)["input_ids"]
    decoder = IncrementalDecoder(tokenizer, [1], ["STOP"], include_stop_str=True)
    pieces = [decoder.add(t) for t in ids]
    assert decoder.stopped
    assert "".join(pieces) == "alpha beta STOP"


def test_special_tokens_are_kept_when_not_skipped(tiny_llama_dir):
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_llama_dir))
    special = tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids = tokenizer("hello", add_special_tokens=False)["input_ids"] + [special]
    kept = IncrementalDecoder(tokenizer, [1], skip_special_tokens=False)
    skipped = IncrementalDecoder(tokenizer, [1])
    kept_text = "".join(kept.add(t) for t in ids) + kept.flush()
    skipped_text = "".join(skipped.add(t) for t in ids) + skipped.flush()
    assert kept_text == skipped_text + "<|im_end|>"


def test_shown_ids_keep_the_eos_text_while_other_special_tokens_are_skipped(tiny_llama_dir):
    # LightLLM's print_eos_token: the detokenizer passes the model's EOS ids as shown_ids.
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_llama_dir))
    eos = tokenizer.eos_token_id
    marker = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert marker != eos
    words = tokenizer("hello there", add_special_tokens=False)["input_ids"]
    ids = words[:1] + [marker] + words[1:] + [eos]
    shown = IncrementalDecoder(tokenizer, [1], shown_ids=[eos])
    plain = IncrementalDecoder(tokenizer, [1])
    shown_text = "".join(shown.add(t) for t in ids) + shown.flush()
    plain_text = "".join(plain.add(t) for t in ids) + plain.flush()
    assert plain_text == tokenizer.decode(ids, skip_special_tokens=True)
    assert shown_text == plain_text + tokenizer.eos_token
    # Without skipping, every special token is shown once already.
    unskipped = IncrementalDecoder(tokenizer, [1], skip_special_tokens=False, shown_ids=[eos])
    text = "".join(unskipped.add(t) for t in ids) + unskipped.flush()
    assert text.count(tokenizer.eos_token) == 1 and "<|im_end|>" in text


def test_a_shown_eos_comes_after_the_bytes_of_an_unfinished_character(tiny_llama_dir):
    # The EOS text went in front of the held-back bytes: "<|im_end|>\ufffd" where the tokenizer
    # decodes "\ufffd<|im_end|>".
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_llama_dir))
    eos = tokenizer.eos_token_id
    character = tokenizer("語", add_special_tokens=False)["input_ids"]
    assert len(character) > 1 and tokenizer.decode(character[:1]) == "\ufffd"  # a byte token
    for ids in (character[:1] + [eos], [tokenizer("hi", add_special_tokens=False)["input_ids"][0]] + character[:2] + [eos]):
        decoder = IncrementalDecoder(tokenizer, [1], shown_ids=[eos])
        pieces = [decoder.add(t) for t in ids] + [decoder.flush()]
        assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=False), pieces
        assert pieces[-2].endswith(tokenizer.eos_token)


def _decode_request(tokenizer, ids, eos_ids=(), **options):
    """Text and stop reason of ``ids`` under a request's options, as the detokenizer decodes them."""
    decoder = request_decoder(tokenizer, [1], SamplingParams(**options), list(eos_ids))
    text = ""
    for token in ids:
        text += decoder.add(token)
        if decoder.stopped:
            break
    return text + decoder.flush(), decoder


def test_a_stop_token_id_ends_without_its_text_unless_asked_and_names_itself(tiny_llama_dir):
    # vLLM: a stop token's text is dropped unless include_stop_str_in_output; stop_reason is its id.
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_llama_dir))
    ids = tokenizer("alpha beta gamma", add_special_tokens=False)["input_ids"]
    stop = ids[-1]
    text, decoder = _decode_request(tokenizer, ids, stop_token_ids=[stop])
    assert text == tokenizer.decode(ids[:-1]) and decoder.stop_reason == stop
    text, decoder = _decode_request(tokenizer, ids, stop_token_ids=[stop], include_stop_str_in_output=True)
    assert text == tokenizer.decode(ids) and decoder.stop_reason == stop


def test_a_generation_config_eos_names_itself_as_vllm_reports_it(tiny_llama_dir):
    # vLLM ends at the tokenizer's EOS with stop_reason null; the checkpoint's other end ids
    # (generation_config's eos_token_id list) are stop token ids there, and name themselves.
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_llama_dir))
    eos = tokenizer.eos_token_id
    other = tokenizer("x", add_special_tokens=False)["input_ids"][0]
    words = tokenizer("hello", add_special_tokens=False)["input_ids"]
    text, decoder = _decode_request(tokenizer, words + [other], [eos, other])
    assert text == "hello" and decoder.stop_reason == other
    _, decoder = _decode_request(tokenizer, words + [eos], [eos, other])
    assert decoder.stop_reason is None


def test_eos_text_is_dropped_even_unskipped_and_reports_no_stop_reason(tiny_llama_dir):
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_llama_dir))
    eos = tokenizer.eos_token_id
    ids = tokenizer("hello", add_special_tokens=False)["input_ids"] + [eos]
    text, decoder = _decode_request(tokenizer, ids, [eos], skip_special_tokens=False, stop_token_ids=[eos])
    assert text == "hello" and decoder.stop_reason is None  # EOS, as vLLM reports it
    text, _ = _decode_request(tokenizer, ids, [eos], skip_special_tokens=False, include_stop_str_in_output=True)
    assert text == "hello" + tokenizer.eos_token
    # ignore_eos: EOS is an ordinary token, kept when special tokens are shown.
    text, _ = _decode_request(tokenizer, ids, [eos], skip_special_tokens=False, ignore_eos=True)
    assert text == "hello" + tokenizer.eos_token
    # LightLLM's print_eos_token keeps it.
    text, _ = _decode_request(tokenizer, ids, [eos], print_eos_token=True)
    assert text == "hello" + tokenizer.eos_token


def test_stop_strings_count_only_from_min_tokens_on(tiny_llama_dir):
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_llama_dir))
    ids = tokenizer("ab STOP cd STOP ef", add_special_tokens=False)["input_ids"]
    first_end = next(i for i in range(len(ids)) if "STOP" in tokenizer.decode(ids[: i + 1]))
    text, decoder = _decode_request(tokenizer, ids, stop_sequences=["STOP"], max_new_tokens=64)
    assert text == "ab " and decoder.stop_reason == "STOP"
    # As in vLLM, a stop string counts only if it ends after the min_tokens-th token's text (where
    # a stop token id may first be sampled): the first STOP ends in token first_end + 1's text.
    for min_new_tokens in (first_end + 1, first_end + 2):
        text, decoder = _decode_request(tokenizer, ids, stop_sequences=["STOP"], max_new_tokens=64,
                                        min_new_tokens=min_new_tokens)
        assert text == "ab STOP cd " and decoder.stop_reason == "STOP"
    # One ending in the next token's text counts.
    text, _ = _decode_request(tokenizer, ids, stop_sequences=["STOP"], max_new_tokens=64,
                              min_new_tokens=first_end)
    assert text == "ab "


def test_a_stop_string_may_begin_in_the_min_tokens_th_token(tiny_llama_dir):
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_llama_dir))
    ids = tokenizer("ab STOP cd", add_special_tokens=False)["input_ids"]
    pieces = [tokenizer.decode(ids[: i + 1]) for i in range(len(ids))]
    ends = next(i for i in range(len(ids)) if "STOP" in pieces[i])
    starts = next(i for i in range(len(ids)) if pieces[i].endswith(("S", " S", "ST", " ST", "STO", " STO")))
    assert starts < ends  # the stop string spans tokens in this tokenizer
    text, decoder = _decode_request(tokenizer, ids, stop_sequences=["STOP"], max_new_tokens=64,
                                    min_new_tokens=starts + 1)
    assert text == "ab " and decoder.stop_reason == "STOP"


def test_a_run_of_invalid_bytes_keeps_the_window_small_and_the_text_whole(tokenizer):
    # Byte-level BPE: the single-byte token for 0xCB starts a 2-byte character the next 0xCB never
    # completes, so every decode of the run ends in U+FFFD.  The window must not grow with the run
    # (each token would re-decode all of it), and the text must still be what a full decode gives.
    lead_byte = tokenizer.convert_tokens_to_ids("Ë")
    valid = tokenizer("你好 world", add_special_tokens=False)["input_ids"]
    ids = valid + [lead_byte] * 300 + valid + [lead_byte] * 3 + valid
    decoder = IncrementalDecoder(tokenizer, [])
    pieces = []
    for token_id in ids:
        pieces.append(decoder.add(token_id))
        assert len(decoder.ids) - decoder.prefix_offset <= 16
    pieces.append(decoder.flush())
    assert "".join(pieces) == tokenizer.decode(ids)


def _byte_token(tokenizer, byte: int) -> int:
    """Id of the byte-level BPE token of one raw byte (GPT-2's byte-to-character alphabet)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {b: chr(b) for b in printable}, 0
    for value in range(256):
        if value not in chars:
            chars[value], extra = chr(256 + extra), extra + 1
    return tokenizer.convert_tokens_to_ids(chars[byte])


def test_bytes_of_an_unfinished_character_end_the_text_as_the_tokenizer_decodes_them(tiny_llama_dir):
    # A generation can end inside a UTF-8 character (max_tokens, a stop token id kept with
    # include_stop_str_in_output): its bytes show as U+FFFD, as tokenizer.decode gives them.
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_llama_dir))
    lead, continuation = _byte_token(tokenizer, 0xE4), _byte_token(tokenizer, 0x80)
    words = tokenizer("plain words", add_special_tokens=False)["input_ids"]
    for ids in ([lead], [continuation], words + [lead], words + [lead, lead, lead], [continuation] + words):
        pieces, decoder = _pieces(tokenizer, ids)
        assert "".join(pieces) + decoder.flush() == tokenizer.decode(ids, skip_special_tokens=True), ids
    text, decoder = _decode_request(tokenizer, words + [lead], stop_token_ids=[lead], include_stop_str_in_output=True)
    assert text == tokenizer.decode(words + [lead]) and decoder.stop_reason == lead


def _byte_fallback_tokenizer(directory):
    """A SentencePiece-style BPE tokenizer (Llama 2, Mistral v0.1): word-start marks, characters
    outside the vocabulary as ``<0xNN>`` byte tokens, a ByteFallback decoder."""
    from tokenizers import Tokenizer, decoders, models, normalizers, trainers
    from transformers import PreTrainedTokenizerFast

    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], limit_alphabet=60)
    trained = Tokenizer(models.BPE(unk_token="<unk>"))
    trained.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    trained.train_from_iterator(["the quick brown fox jumps over the lazy dog ok"] * 20, trainer)
    learned = trained.get_vocab()
    vocab = {token: index for index, token in enumerate(["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)])}
    for token in sorted(learned, key=learned.get):
        vocab.setdefault(token, len(vocab))
    merges = [tuple(merge) for merge in __import__("json").loads(trained.to_str())["model"]["merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    tok.normalizer = trained.normalizer
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.save_pretrained(directory)
    return AutoTokenizer.from_pretrained(str(directory))


def test_output_after_a_prompt_ending_in_byte_tokens_decodes_as_the_tokenizer_does(tmp_path):
    """The prompt window used to start among a character's byte tokens; the byte-fallback decoder
    then turned the whole run, the output's characters included, into U+FFFD ("x 語" + "文字ok")."""
    tokenizer = _byte_fallback_tokenizer(tmp_path)
    assert tokenizer.convert_ids_to_tokens(tokenizer("語", add_special_tokens=False)["input_ids"])[-1] == "<0x9E>"
    prompts = ["x 語", "x 😀語", "x 🎉😀", "the 日本", "fox 字", "ok"]
    outputs = ["文字ok", "😀 ok", "é", "字", "the fox"]
    for prompt in prompts:
        prompt_ids = tokenizer(prompt)["input_ids"]
        for output in outputs:
            ids = tokenizer(output, add_special_tokens=False)["input_ids"]
            if tokenizer.convert_ids_to_tokens(ids[0]) == "▁":
                ids = ids[1:]  # a model can continue a word: the output's bytes join the prompt's run
            decoder = IncrementalDecoder(tokenizer, prompt_ids)
            pieces = [decoder.add(token_id) for token_id in ids]
            whole = tokenizer.decode(prompt_ids + ids, skip_special_tokens=True)
            expected = whole[len(tokenizer.decode(prompt_ids, skip_special_tokens=True)):]
            assert "".join(pieces) + decoder.flush() == expected, (prompt, output)
            assert expected.strip() == output.strip()
            assert all("\ufffd" not in piece for piece in pieces), (prompt, output)
    # A lone invalid byte after such a prompt is one U+FFFD, as the tokenizer decodes it.
    lone = [tokenizer.convert_tokens_to_ids("<0x80>")]
    decoder = IncrementalDecoder(tokenizer, tokenizer("日本語 🎉")["input_ids"])
    assert "".join(decoder.add(token_id) for token_id in lone) + decoder.flush() == tokenizer.decode(lone) == "\ufffd"


def test_of_overlapping_stop_strings_the_one_that_ends_first_wins_as_in_vllm(tiny_llama_dir):
    """Of the stop strings complete in the released text, the one that ends first wins, ties going
    to list order (it was the one that starts first, then the shortest)."""
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_llama_dir))
    cases = [
        ("alpha _args beta", ["_args", "rg"], "alpha _a", "rg"),
        ("alpha dedlatin beta", ["latin", "dedlatin"], "alpha ded", "latin"),
        ("alpha dedlatin beta", ["dedlatin", "latin"], "alpha ", "dedlatin"),
        ("alpha beta", ["ta", "lph"], "a", "lph"),
    ]
    for text, stops, kept, reason in cases:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        whole = IncrementalDecoder(tokenizer, [1], stops)
        pieces = [whole.add(t) for t in ids]
        assert whole.stopped, (text, stops)
        assert "".join(pieces) == kept and whole.stop_reason == reason, (text, stops, pieces, whole.stop_reason)
