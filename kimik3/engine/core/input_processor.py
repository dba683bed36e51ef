"""Request intake: a user's prompt and SamplingParams checked against the model and the engine's
limits, then turned into the ``Request`` of each of its ``n`` samples.

Every check runs before anything is built, and building cannot fail after them, so a request is
either wholly accepted or leaves no trace (the engine queues its samples only then). The tokenizer
(for text prompts, stop strings, bad words and detokenized outputs) and the grammar compiler (for
structured outputs) are loaded on first use.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

import torch

from kimik3.engine.config import EngineConfig
from kimik3.engine.core.detokenizer import OutputText
from kimik3.engine.core.request import Request
from kimik3.engine.images.multimodal import build_multi_modal_input, check_vision_inputs
from kimik3.engine.sample.logit_controls import BadWords
from kimik3.engine.sample.sampling_params import SamplingParams, check_seed
from kimik3.vision.preprocess import VisionInputs

logger = logging.getLogger(__name__)

_NO_TOKENIZER = object()
_PROMPT_KEYS = {"prompt_token_ids", "prompt", "multi_modal_data"}


@dataclass
class CheckedPrompt:
    text: str | None                    # the prompt's text, if it came as text
    token_ids: list[int]
    vision: VisionInputs | None         # its images, checked against the pads
    pad_positions: list[int] | None     # prompt positions of the images' pad tokens


class InputProcessor:
    def __init__(self, model_config, config: EngineConfig, device: torch.device, tokenizer=None,
                 tokenizer_path: str | None = None):
        self.model_config = model_config
        self.config = config
        self.device = device
        self.vocab_size = model_config.text.vocab_size
        self.eos_token_id = model_config.text.eos_token_id
        self._tokenizer = tokenizer
        self._tokenizer_path = tokenizer_path
        self._tokenizer_error: Exception | None = None
        self._grammar = None    # structured.GrammarCompiler, built on the first constrained request
        self._grammar_lock = threading.Lock()

    def get_tokenizer(self, required: bool = False):
        if self._tokenizer is None:
            try:
                from kimik3.tokenizer import load_tokenizer
                if self._tokenizer_path is None:
                    raise ValueError("no tokenizer path was given")
                self._tokenizer = load_tokenizer(self._tokenizer_path)
            except Exception as e:  # no or unreadable tokenizer files (tiny test checkpoints): token ids only
                logger.info("no tokenizer at %s (%s): outputs carry token ids only", self._tokenizer_path, e)
                self._tokenizer, self._tokenizer_error = _NO_TOKENIZER, e
        if self._tokenizer is _NO_TOKENIZER:
            if required:
                raise ValueError(f"this needs a tokenizer, but none could be loaded from {self._tokenizer_path} "
                                 f"({self._tokenizer_error}); pass {{'prompt_token_ids': [...]}} prompts and "
                                 f"stop_token_ids instead of text")
            return None
        return self._tokenizer

    def grammar_compiler(self):
        """The llguidance compiler over the tokenizer (built on first use; needs a tokenizer). Thread-safe, as
        the compiler is: the server prepares constraints off the engine thread."""
        with self._grammar_lock:
            if self._grammar is None:
                from kimik3.engine.sample.structured import GrammarCompiler
                tok = self.get_tokenizer(required=True)
                ends = [self.eos_token_id, *getattr(tok, "stop_token_ids", [])]
                self._grammar = GrammarCompiler(tok, self.vocab_size, [t for t in ends if t is not None],
                                                timeout=self.config.grammar_compile_timeout,
                                                memory_bytes=self.config.grammar_compile_memory)
            return self._grammar

    # ---- checks ------------------------------------------------------------------------------
    def check(self, prompt, params: SamplingParams, multi_modal_data: VisionInputs | None = None) -> CheckedPrompt:
        """The prompt's text, ids and images, or ValueError naming what is wrong."""
        text, ids, vision = self._prompt_ids(prompt)
        if multi_modal_data is not None:
            if vision is not None:
                raise ValueError("images given twice (in the prompt's multi_modal_data and as multi_modal_data=); "
                                 "give them once")
            vision = multi_modal_data
        self._check_params(ids, params)
        return CheckedPrompt(text, ids, vision, self._check_images(ids, vision))

    def _prompt_ids(self, prompt) -> tuple[str | None, list[int], VisionInputs | None]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty; give at least one token")
            return prompt, list(self.get_tokenizer(required=True).encode(prompt)), None
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            unknown = sorted(set(prompt) - _PROMPT_KEYS, key=str)
            if unknown:
                raise ValueError(f"unknown prompt key(s) {unknown}; a prompt dict takes {sorted(_PROMPT_KEYS)}")
            ids = prompt["prompt_token_ids"]
            if not isinstance(ids, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool)
                                                              for t in ids):
                raise ValueError(f"prompt_token_ids must be a list of ints, got {type(ids).__name__}")
            return prompt.get("prompt"), list(ids), prompt.get("multi_modal_data")
        raise ValueError(f"a prompt is a string or {{'prompt_token_ids': [...]}}, got {type(prompt).__name__}")

    def _check_ids(self, what: str, ids, fix: str) -> None:
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"{what} {bad[:5]} lie outside the vocabulary [0, {self.vocab_size}){fix}")

    def _check_params(self, ids: list[int], params: SamplingParams) -> None:
        cfg = self.config
        check_seed(params.seed, params.n)     # again: the fields may have changed since construction
        if not ids:
            raise ValueError("prompt is empty (0 tokens); give at least one token")
        self._check_ids("prompt token ids", ids, "")
        if len(ids) > cfg.max_model_len:
            pad = self.model_config.media_placeholder_token_id
            n_img = sum(1 for t in ids if t == pad) if pad is not None else 0
            what = f" ({n_img} of them image tokens)" if n_img else ""
            fix = "use fewer or smaller images, shorten the text" if n_img else "shorten it"
            raise ValueError(f"prompt has {len(ids)} tokens{what}, more than max_model_len="
                             f"{cfg.max_model_len}; {fix} or raise max_model_len")
        if params.logprobs is not None and params.logprobs > cfg.max_logprobs:
            raise ValueError(f"logprobs={params.logprobs} is more than max_logprobs={cfg.max_logprobs}; "
                             f"ask for fewer or raise max_logprobs")
        self._check_ids("stop_token_ids", params.stop_token_ids, "; remove them")
        if params.stop_strings:
            if not params.detokenize:
                raise ValueError(f"stop strings {params.stop_strings} need detokenize=True")
            self.get_tokenizer(required=True)
        self._check_ids("logit_bias: token ids", list(params.logit_bias or ()), "; remove them")
        self._check_ids("allowed_token_ids: token ids", params.allowed_token_ids or [], "; remove them")
        if params.bad_words:
            self.get_tokenizer(required=True)
        self._check_ids("bad_token_sequences: token ids", [t for w in params.bad_token_sequences or () for t in w],
                        "; remove them")
        self._check_allowed_ids(params)
        if params.structured_outputs is not None:
            compiler = self.grammar_compiler()
            compiler.check(params.structured_outputs)
            if params.allowed_token_ids and not compiler.first_allows(params.structured_outputs,
                                                                      params.allowed_token_ids):
                raise ValueError(f"allowed_token_ids {params.allowed_token_ids[:8]} hold none of the tokens that the "
                                 f"structured_outputs constraint lets the output start with: nothing could be sampled; "
                                 f"allow such tokens or drop one of the two")

    def _check_allowed_ids(self, params: SamplingParams) -> None:
        """ValueError when ``allowed_token_ids`` leaves nothing to sample: every allowed id is a one-token bad
        word, or (before ``min_tokens``) an end token that min_tokens holds back."""
        allowed = set(params.allowed_token_ids or ())
        if not allowed:
            return
        bad = self._bad_words(params)
        banned = {w[0] for w in bad.seqs if len(w) == 1} if bad is not None else set()
        if params.min_tokens:
            held = {self.eos_token_id, *params.stop_token_ids} - {None}
            if allowed <= banned | held:
                raise ValueError(f"allowed_token_ids {sorted(allowed)[:8]} are all end tokens or bad words, which "
                                 f"min_tokens={params.min_tokens} holds back: nothing could be sampled; allow more "
                                 f"tokens or drop min_tokens")
        if allowed <= banned:
            raise ValueError(f"allowed_token_ids {sorted(allowed)[:8]} are all banned by bad_words: nothing could be "
                             f"sampled; allow other tokens or drop those bad words")

    def _check_images(self, ids: list[int], vision) -> list[int] | None:
        """Pad positions of a prompt's images (checked against the model), or None without images."""
        if vision is None:
            return None
        vc, pad = self.model_config.vision, self.model_config.media_placeholder_token_id
        if vc is None or pad is None:
            raise ValueError("this model has no vision tower (its config.json has no vision_config), so it "
                             "cannot take images; send text only")
        return check_vision_inputs(vision, ids, pad, vc.patch_size, vc.merge_kernel_size[0])

    # ---- building --------------------------------------------------------------------------------
    def make_requests(self, request_id: str, prompt: CheckedPrompt, params: SamplingParams, arrival: float,
                      share_prefix: bool) -> list[Request]:
        """The ``params.n`` samples of a checked prompt (cannot fail). ``share_prefix``: samples 2..n
        wait for sample 1's prompt blocks (prefix caching is on)."""
        ids, bs = prompt.token_ids, self.config.block_size
        mm = build_multi_modal_input(prompt.vision, prompt.pad_positions) if prompt.vision is not None else None
        extra_keys = mm.block_extra_keys(len(ids), bs) if mm is not None else None
        tok = self.get_tokenizer() if params.detokenize else None
        bad_words = self._bad_words(params)
        so = params.structured_outputs
        children: list[Request] = []
        for i in range(params.n):
            seed = None if params.seed is None else params.seed + i
            req = Request(request_id if params.n == 1 else f"{request_id}#{i}", ids, params, arrival, seed,
                          self.eos_token_id, bs, extra_keys=extra_keys, mm=mm, group_id=request_id,
                          bad_words=bad_words,
                          matcher=self.grammar_compiler().matcher(so) if so is not None else None)
            if i and share_prefix and len(ids) > bs:
                req.wait_for = children[0]
            if tok is not None:
                req.out.detok = OutputText(tok, params.stop_strings, params.skip_special_tokens,
                                           params.include_stop_str_in_output)
            children.append(req)
        return children

    def _bad_words(self, params: SamplingParams) -> BadWords | None:
        """Token sequences of each bad word, as written and after a space (vLLM's rule), and the given
        ``bad_token_sequences``, deduplicated."""
        if not params.bad_words and not params.bad_token_sequences:
            return None
        seqs: dict[tuple[int, ...], None] = {tuple(w): None for w in params.bad_token_sequences or ()}
        tok = self.get_tokenizer(required=True) if params.bad_words else None
        for w in params.bad_words or ():
            for text in (w, " " + w.lstrip()):
                ids = tuple(tok.encode(text))
                if ids:
                    seqs[ids] = None
        return BadWords([list(w) for w in seqs])
