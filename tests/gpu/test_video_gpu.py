"""Video on CUDA: a chat with a video (4-frame chunks, t = 4 tower items) and an image through ``LLM.chat`` on the
GPU, with the encoder's CUDA graphs and eagerly: the same prompt as the CPU renders, and the same greedy tokens
in both modes."""

from __future__ import annotations

import pytest
import torch

import kimik3
from kimik3 import LLM, SamplingParams
from tests.serve.test_errors import png_data_url
from tests.vision.videos import data_url, make_video

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_video_chat_on_cuda_graphs_and_eager():
    pytest.importorskip("av")
    msgs = [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": data_url(make_video(
        n=32, fps=8, w=112, h=84))}}, {"type": "image_url", "image_url": {"url": png_data_url(60, 40)}},
        {"type": "text", "text": "What happens?"}]}]
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    out, prompts = {}, {}
    for eager in (True, False):
        llm = LLM(str(kimik3.DEFAULT_MODEL), device="cuda", dtype="bfloat16", enforce_eager=eager,
                  max_model_len=2048, max_num_seqs=2, use_tqdm_on_load=False)
        r = llm.chat(msgs, greedy, use_tqdm=False, media_io_kwargs={"video": {"fps": 4}})[0]
        out[eager], prompts[eager] = r.outputs[0].token_ids, r.prompt_token_ids
        del llm
        torch.cuda.empty_cache()
    cpu = LLM(str(kimik3.DEFAULT_MODEL), device="cpu", dtype="float32", max_model_len=2048, max_num_seqs=2,
              use_tqdm_on_load=False)
    want = cpu.chat(msgs, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False,
                    media_io_kwargs={"video": {"fps": 4}})[0].prompt_token_ids
    pad = cpu.engine.model.config.media_placeholder_token_id
    # 32 frames at 8 fps sampled at 4: 16 frames, 4 chunks of a 112x84 frame's 3x4 tokens, then 60x40's 2x3
    assert prompts[True] == prompts[False] == want and want.count(pad) == 4 * 12 + 6
    assert out[True] == out[False]
