"""Images and videos through `/v1/chat/completions` and `LLM.chat` (issue 44): a tiny random Qwen2.5-VL checkpoint with its image
processor and a word-level tokenizer whose chat template writes Qwen's vision placeholders.

A data: URL, an http URL fetched by the API process and a file:// path under `--allowed-local-media-path` give the
same answer as the offline `LLM.chat` on the same conversation (the offline path is checked against transformers
in notebook 31b); bad images are 400s in OpenAI's error shape and leave the server serving. A video file as a data: URL
(decoded by PyAV, skipped without it) gives LLM.chat's answer; too many videos and a file that is not a video are 400s.
"""

from __future__ import annotations
import base64
import json
import http.server
import io
import threading
from pathlib import Path
import httpx
import numpy as np
import pytest
from _serverproc import ServerProcess, free_port

TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }} {% if m['content'] is string %}{{ m['content'] }} {% else %}"
    "{% for p in m['content'] %}{% if p['type'] == 'text' %}{{ p['text'] }} "
    "{% elif p['type'] == 'video' %}<|vision_start|><|video_pad|><|vision_end|> {% else %}"
    '<|vision_start|><|image_pad|><|vision_end|> {% endif %}{% endfor %}{% endif %}{% endfor %}'
    '{% if add_generation_prompt %}assistant {% endif %}'
)


def tiny_qwen2_5_vl(d):
    "A tiny random Qwen2.5-VL checkpoint, its image processor and a 256-word tokenizer with a chat template, in `d`."
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
    from transformers import Qwen2VLImageProcessorPil

    vocab = {f'w{i}': i for i in range(240)} | {'user': 240, 'assistant': 241, 'system': 242, '<unk>': 243}
    vocab |= {'<eos>': 244, '<|vision_start|>': 248, '<|vision_end|>': 249, '<|image_pad|>': 250, '<|video_pad|>': 251}
    vocab |= {f'x{i}': i for i in range(256) if i not in vocab.values()}
    t = Tokenizer(models.WordLevel(vocab, unk_token='<unk>'))
    t.pre_tokenizer, t.decoder = pre_tokenizers.WhitespaceSplit(), decoders.WordPiece()
    specials = ['<eos>', '<|vision_start|>', '<|vision_end|>', '<|image_pad|>', '<|video_pad|>']
    tok = PreTrainedTokenizerFast(
        tokenizer_object=t, unk_token='<unk>', eos_token='<eos>', additional_special_tokens=specials[1:]
    )
    tok.chat_template = TEMPLATE
    tok.save_pretrained(d)
    cfg = Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=256,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=512,
            initializer_range=0.1,
            rope_parameters=dict(rope_type='default', rope_theta=10000.0, mrope_section=[2, 3, 3]),
        ),
        vision_config=dict(
            depth=2,
            hidden_size=32,
            intermediate_size=48,
            num_heads=2,
            out_hidden_size=64,
            patch_size=4,
            spatial_merge_size=2,
            temporal_patch_size=2,
            window_size=16,
            fullatt_block_indexes=[1],
            initializer_range=0.1,
        ),
        image_token_id=250,
        video_token_id=251,
        vision_start_token_id=248,
        vision_end_token_id=249,
        eos_token_id=244,
        bos_token_id=None,
    )
    torch.manual_seed(0)
    Qwen2_5_VLForConditionalGeneration(cfg).save_pretrained(d)
    Qwen2VLImageProcessorPil(
        patch_size=4, merge_size=2, temporal_patch_size=2, min_pixels=256, max_pixels=1024
    ).save_pretrained(d)


def png(h, w, seed) -> bytes:
    from PIL import Image

    b = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)).save(b, 'PNG')
    return b.getvalue()


def data_url(b: bytes) -> str:
    return 'data:image/png;base64,' + base64.b64encode(b).decode()


def mp4(seed: int, frames: int = 4) -> bytes:
    "A small MPEG-4 clip of random 20 x 28 frames (PyAV)."
    import av

    rng, b = np.random.default_rng(seed), io.BytesIO()
    with av.open(b, 'w', format='mp4') as c:
        s = c.add_stream('mpeg4', rate=4)
        s.width, s.height, s.pix_fmt = 28, 20, 'yuv420p'
        for _ in range(frames):
            f = rng.integers(0, 256, (20, 28, 3), dtype=np.uint8)
            c.mux(s.encode(av.VideoFrame.from_ndarray(f, format='rgb24')))
        c.mux(s.encode())
    return b.getvalue()


def video_part(b: bytes) -> dict:
    return {'type': 'video_url', 'video_url': {'url': 'data:video/mp4;base64,' + base64.b64encode(b).decode()}}


def ask(*urls, text='w5 w6'):
    parts = [{'type': 'image_url', 'image_url': {'url': u}} for u in urls]
    return [{'role': 'user', 'content': [{'type': 'text', 'text': text}, *parts]}]


@pytest.fixture(scope='module')
def model(tmp_path_factory):
    d = tmp_path_factory.mktemp('tiny_qwen2_5_vl')
    tiny_qwen2_5_vl(d)
    media = tmp_path_factory.mktemp('media')
    (media / 'a.png').write_bytes(png(20, 28, 1))
    return d, media


@pytest.fixture(scope='module')
def server(model):
    d, media = model
    with ServerProcess(
        '--model',
        str(d),
        '--max-model-len',
        '512',
        '--mem',
        '16',
        '--dtype',
        'float32',
        '--limit-mm-per-prompt',
        '{"image": 2}',
        '--allowed-local-media-path',
        str(media),
        '--ui-server',
    ) as s:
        yield s


@pytest.fixture(scope='module')
def web():
    "A local http server with one image, for URLs the API process fetches."
    body = png(20, 28, 1)

    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == '/a.png' else 404)
            self.end_headers()
            self.wfile.write(body if self.path == '/a.png' else b'')

        def log_message(self, *a):
            pass

    srv = http.server.ThreadingHTTPServer(('127.0.0.1', 0), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f'http://127.0.0.1:{srv.server_port}'
    srv.shutdown()


def post(s, messages, **kw):
    body = {'messages': messages, 'max_tokens': 8, 'temperature': 0, 'ignore_eos': True, **kw}
    return httpx.post(s.url + '/v1/chat/completions', json=body, timeout=120)


def test_images_match_offline_chat(server, model, web):
    "data:, http and file:// URLs of the same picture: one answer, the offline LLM.chat's; two images; another picture differs."
    from cvllm_lab import LLM, SamplingParams

    d, media = model
    a, b = png(20, 28, 1), png(36, 16, 2)
    llm = LLM(str(d), progress=False, dtype='float32', limit_mm_per_prompt={'image': 2}, kv_cache_memory=8 << 20)
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    want = [
        o.outputs[0]
        for o in llm.chat([ask(data_url(a)), ask(data_url(b)), ask(data_url(b), data_url(a))], sp, use_tqdm=False)
    ]
    assert want[0].token_ids != want[1].token_ids  # the image matters
    for u in (data_url(a), f'{web}/a.png', f'file://{media}/a.png'):
        r = post(server, ask(u))
        assert r.status_code == 200, r.text
        assert r.json()['choices'][0]['message']['content'] == want[0].text, u
        assert (
            r.json()['usage']['prompt_tokens'] == 3 + 2 + 8 + 1
        )  # 'user w5 w6', start and end, 8 image rows, 'assistant'
    r = post(server, ask(data_url(b), data_url(a)))
    assert r.status_code == 200, r.text
    assert r.json()['choices'][0]['message']['content'] == want[2].text


def _err(r, *words):
    assert r.status_code == 400, r.text
    e = r.json()['error']
    assert set(e) >= {'message', 'type', 'param', 'code'} and e['type'] == 'BadRequestError', e
    for w in words:
        assert w in e['message'], e


def test_bad_images_are_400(server, model, web):
    d, media = model
    good = data_url(png(20, 28, 1))
    _err(post(server, ask(data_url(b'not an image'))), 'not an image')
    _err(post(server, ask('data:image/png;base64,@@')), 'base64')
    _err(post(server, ask(f'http://127.0.0.1:{free_port()}/a.png')), 'Could not fetch')
    _err(post(server, ask(f'{web}/missing.png')), 'Could not fetch')
    _err(post(server, ask(good, good, good)), 'At most 2 image')
    _err(post(server, ask(f'file://{d}/config.json')), 'outside --allowed-local-media-path')
    _err(post(server, [{'role': 'user', 'content': [{'type': 'image_url', 'image_url': {}}]}]))
    _err(post(server, ask(good), use_beam_search=True, n=2), 'Beam search')
    r = post(server, ask(good))  # and the server goes on serving
    assert r.status_code == 200, r.text


def test_chat_page_attaches_an_image(server, model):
    "The web page's Image button: the picture is shown, sent as an image_url part, and the answer is the API's."
    chromium = Path('/usr/bin/chromium')
    if not chromium.exists():
        pytest.skip('Debian chromium is not installed (apt-get install -y chromium chromium-driver)')
    sync_api = pytest.importorskip('playwright.sync_api', reason='the playwright Python package is not installed')
    d, media = model
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=str(chromium), args=['--headless', '--no-sandbox', '--disable-gpu'])
        pg = b.new_page()
        pg.goto(server.url + '/')
        pg.wait_for_function("document.querySelectorAll('#model option').length > 0")
        for k, v in (('temperature', 0), ('max_tokens', 8)):
            pg.fill(f'#{k}', str(v))
            pg.dispatch_event(f'#{k}', 'change')
        pg.set_input_files('#image', str(media / 'a.png'))
        pg.wait_for_function("document.querySelectorAll('#attached img').length === 1")
        pg.fill('#prompt', 'w5 w6')
        pg.click('#send')
        pg.wait_for_function("JSON.parse(localStorage.getItem('cvllm.history') || '[]').length === 2")
        assert len(pg.query_selector_all('.msg.user img.att')) == 1
        assert pg.query_selector_all('#attached img') == []  # sent: nothing attached to the next message
        history = json.loads(pg.evaluate("localStorage.getItem('cvllm.history')"))
        b.close()
    assert history[0]['images'][0].startswith('data:image/png;base64,')
    want = post(server, ask(data_url((media / 'a.png').read_bytes())), ignore_eos=False)
    assert want.status_code == 200, want.text
    assert history[1]['content'] == want.json()['choices'][0]['message']['content']


def test_videos_match_offline_chat(server, model):
    "A video_url data: URL: LLM.chat's answer, its placeholder run t*h*w/4 tokens; too many videos and not-a-video are 400s."
    pytest.importorskip('av')
    from cvllm_lab import LLM, SamplingParams

    d, _ = model
    clip = [{'role': 'user', 'content': [{'type': 'text', 'text': 'w5 w6'}, video_part(mp4(3))]}]
    llm = LLM(str(d), progress=False, dtype='float32', kv_cache_memory=8 << 20)
    want = llm.chat([clip], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)[0]
    r = post(server, clip)
    assert r.status_code == 200, r.text
    assert r.json()['choices'][0]['message']['content'] == want.outputs[0].text
    assert r.json()['usage']['prompt_tokens'] == 3 + 2 + 16 + 1  # 4 frames at 16 x 32: 2 temporal patches x 4 x 8 / 4
    two = [{'role': 'user', 'content': [video_part(mp4(3)), video_part(mp4(4))]}]
    _err(post(server, two), 'At most 1 video')
    _err(post(server, [{'role': 'user', 'content': [video_part(b'not a video')]}]), 'not a video')
    _err(post(server, [{'role': 'user', 'content': [{'type': 'video_url', 'video_url': {}}]}]))
    assert post(server, clip).status_code == 200  # and the server goes on serving
