"""The `--ui-server` chat page and the docs site in headless Chromium (Debian's package, driven by Playwright).
No screenshots are written."""

from __future__ import annotations
import functools
import http.server
import json
import sys
import threading
import time
from pathlib import Path
import httpx
import pytest

CHROMIUM = Path('/usr/bin/chromium')
if not CHROMIUM.exists():
    pytest.skip(
        'Debian chromium is not installed (apt-get install -y chromium chromium-driver)', allow_module_level=True
    )
sync_api = pytest.importorskip(
    'playwright.sync_api', reason='the playwright Python package is not installed (pip install playwright)'
)
from _serverproc import ServerProcess, free_port, metric  # noqa: E402 (after the skips)

ROOT = Path(__file__).resolve().parents[1]
ARGS = [
    '--headless',
    '--no-sandbox',
    '--disable-gpu',
    '--disable-background-networking',
    '--disable-component-update',
    '--disable-sync',
    '--no-first-run',
    '--disable-quic',
]


@pytest.fixture(scope='module')
def browser():
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=str(CHROMIUM), args=ARGS, headless=True)
        yield b
        b.close()


@pytest.fixture(scope='module')
def server():
    # batch-invariant: the page's answer is compared with the same request's through the API, which meets the first's
    # prompt in the prefix cache (on the CPU fast path a cached prefix may otherwise flip a near-tie of greedy tokens)
    args = ('--max-model-len', '512', '--mem', '32', '--served-model-name', 'smol', '--ui-server', '--batch-invariant')
    with ServerProcess(*args) as s:
        yield s


@pytest.fixture
def page(browser):
    ctx = browser.new_context()
    pg = ctx.new_page()
    pg.set_default_timeout(60_000)
    yield pg
    ctx.close()


def settings(page, **kw):
    for k, v in kw.items():
        page.fill(f'#{k}', str(v))
        page.dispatch_event(f'#{k}', 'change')


def test_chat_page_streams_an_answer(server, page):
    page.goto(server.url + '/')
    assert page.title() == 'cvllm_lab chat'
    page.wait_for_function("document.querySelectorAll('#model option').length > 0")
    assert page.input_value('#model') == 'smol'
    settings(page, temperature=0, max_tokens=24)
    page.fill('#prompt', 'Write a short poem about the sea.')
    page.click('#send')
    # part of the answer is on the page while the request is still streaming
    page.wait_for_function(
        "document.body.dataset.state === 'streaming' && "
        "document.querySelector('.msg.assistant .body').textContent.trim().length > 0"
    )
    assert page.is_enabled('#stop') and not page.is_enabled('#send')
    page.wait_for_function("document.body.dataset.state === 'idle'")
    assert 'finish: ' in page.text_content('.msg.assistant .meta')
    history = json.loads(page.evaluate("localStorage.getItem('cvllm.history')"))
    assert [m['role'] for m in history] == ['user', 'assistant']
    want = httpx.post(
        server.url + '/v1/chat/completions',
        timeout=120,
        json=dict(
            messages=[{'role': 'user', 'content': 'Write a short poem about the sea.'}], temperature=0, max_tokens=24
        ),
    ).json()
    assert history[1]['content'] == want['choices'][0]['message']['content']
    assert page.text_content('.msg.assistant .body').split()[0] in history[1]['content']
    # a second turn goes with the history; the conversation survives a reload; New chat clears it
    page.fill('#prompt', 'Thanks!')
    page.press('#prompt', 'Enter')
    page.wait_for_function("document.querySelectorAll('.msg').length === 4 && document.body.dataset.state === 'idle'")
    page.reload()
    page.wait_for_function("document.querySelectorAll('.msg').length === 4")
    assert page.input_value('#max_tokens') == '24'  # settings are kept too
    page.click('#new-chat')
    assert page.query_selector_all('.msg') == []


PLACEHOLDER_ROOM = """() => [...document.querySelectorAll('aside input[placeholder]')].map((el) => {
  const cs = getComputedStyle(el), ctx = document.createElement('canvas').getContext('2d');
  ctx.font = cs.font;
  const spinner = el.type === 'number' ? 16 : 0;  // room Chromium keeps for a number field's arrows
  const room = el.clientWidth - parseFloat(cs.paddingLeft) - parseFloat(cs.paddingRight) - spinner;
  return [el.id, el.placeholder, ctx.measureText(el.placeholder).width, room];
})"""


def test_chat_page_defaults(server, page):
    "max_tokens starts at a few hundred (not the context), placeholders fit their fields, no 404 (favicon) on load."
    bad = []
    page.on('response', lambda r: bad.append((r.status, r.url)) if r.status >= 400 else None)
    page.goto(server.url + '/')
    page.wait_for_function("document.querySelectorAll('#model option').length > 0")
    assert page.input_value('#max_tokens') == '256'
    fields = page.evaluate(PLACEHOLDER_ROOM)
    assert {f[0] for f in fields} >= {'temperature', 'top_p', 'top_k', 'max_tokens'}
    assert [f for f in fields if f[2] > f[3]] == [], fields  # [id, placeholder, text width, room]: cut off
    # the page's icon (headless Chromium fetches no icons itself): /favicon.ico, which a browser asks for anyway
    icon = page.evaluate(
        "async () => { const r = await fetch(document.querySelector('link[rel=icon]').href);"
        " return [new URL(r.url).pathname, r.status, r.headers.get('content-type')]; }"
    )
    assert icon == ['/favicon.ico', 200, 'image/svg+xml'] and bad == [], (icon, bad)
    # the request the page sends by default carries max_tokens=256
    with page.expect_request('**/v1/chat/completions') as req:
        page.fill('#prompt', 'Hi')
        page.click('#send')
    assert json.loads(req.value.post_data)['max_tokens'] == 256
    page.click('#stop')
    page.wait_for_function("document.body.dataset.state === 'idle'")
    # settings saved by the page before max_tokens had a default (an empty field) don't bring back "to the context end"
    page.evaluate("localStorage.setItem('cvllm.settings', JSON.stringify({max_tokens: '', temperature: '0.5'}))")
    page.reload()
    assert (page.input_value('#max_tokens'), page.input_value('#temperature')) == ('256', '0.5')
    settings(page, max_tokens='')  # emptied on purpose now: stays empty (no limit)
    page.reload()
    assert page.input_value('#max_tokens') == ''


def test_stop_button_aborts(server, page):
    aborted = metric(server.url, 'cvllm:request_aborted_total')
    page.goto(server.url + '/')
    page.wait_for_function("document.querySelectorAll('#model option').length > 0")
    settings(page, temperature=0.8, max_tokens=400)
    page.fill('#prompt', 'Tell me a very long story about a dragon.')
    page.click('#send')
    page.wait_for_function("document.querySelector('.msg.assistant .body').textContent.trim().length > 10")
    page.click('#stop')
    page.wait_for_function("document.body.dataset.state === 'idle'")
    assert page.text_content('#status') == 'Stopped.'
    deadline = time.time() + 10
    while time.time() < deadline and metric(server.url, 'cvllm:request_aborted_total') < aborted + 1:
        time.sleep(0.2)
    assert metric(server.url, 'cvllm:request_aborted_total') == aborted + 1
    assert metric(server.url, 'cvllm:num_requests_running') == 0


def test_markdown_renderer(server, page):
    page.goto(server.url + '/')
    md = lambda s: page.evaluate('s => window.cvllmMarkdown(s)', s)
    assert md('# Title\n\n**bold**, *it* and `a<b`\n\n- one\n- two\n\n1. first\n\n```py\nx = 1 < 2\n```') == (
        '<h1>Title</h1><p><strong>bold</strong>, <em>it</em> and <code>a&lt;b</code></p>'
        '<ul><li>one</li><li>two</li></ul><ol><li>first</li></ol><pre><code class="language-py">x = 1 &lt; 2</code></pre>'
    )
    assert md('<script>alert(1)</script> <img src=x onerror=alert(1)>') == (
        '<p>&lt;script&gt;alert(1)&lt;/script&gt; &lt;img src=x onerror=alert(1)&gt;</p>'
    )
    assert md('[link](https://example.com) [bad](javascript:alert(1)) snake_case_name') == (
        '<p><a href="https://example.com" target="_blank" rel="noopener noreferrer">link</a> [bad](javascript:alert(1)) snake_case_name</p>'
    )
    assert (
        md('| a | b |\n|---|---|\n| 1 | 2 |')
        == '<table><tr><th>a</th><th>b</th></tr><tr><td>1</td><td>2</td></tr></table>'
    )
    assert md('line one\nline two\n\n> quoted') == '<p>line one<br>line two</p><blockquote><p>quoted</p></blockquote>'


@pytest.fixture(scope='module')
def docs_dir(tmp_path_factory):
    "A docs site of two notebooks (`tools/build_docs.py`)."
    sys.path.insert(0, str(ROOT / 'tools'))
    import build_docs

    tmp = tmp_path_factory.mktemp('docs')
    build_docs.build(build_dir=tmp / 'build', site_dir=tmp / 'site', only=['00_config', '77_api_server'])
    return tmp / 'site'


@pytest.fixture(scope='module')
def docs_site(docs_dir):

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *a):
            pass

    httpd = http.server.ThreadingHTTPServer(
        ('127.0.0.1', free_port()), functools.partial(Quiet, directory=str(docs_dir))
    )
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f'http://127.0.0.1:{httpd.server_address[1]}'
    httpd.shutdown()


def test_docs_site(docs_site, page):
    page.goto(docs_site + '/index.html', wait_until='domcontentloaded')
    assert page.title() == 'cvllm_lab'
    assert 'cvllm_lab' in page.text_content('article')
    page.locator('a.md-nav__link', has_text='OpenAI-compatible API server').first.click()
    page.wait_for_url('**/77_api_server.html')
    article = page.text_content('article')
    assert 'OpenAI-compatible API server' in page.text_content('h1')
    assert 'def build_app' in article and 'class OpenAIServing' in article
    assert 'def check_error' not in article and '#| export' not in article and 'default_exp' not in article
    page.goto(docs_site + '/00_config.html', wait_until='domcontentloaded')
    assert 'EngineConfig' in page.text_content('article')


def test_docs_404_from_file(docs_dir, page):
    "404.html opened from disk (file://) finds its stylesheet and its links lead to pages (mkdocs writes them root-absolute)."
    page.goto((docs_dir / '404.html').as_uri(), wait_until='load')
    assert page.evaluate("getComputedStyle(document.querySelector('.md-header')).position") == 'sticky'
    page.locator('a.md-nav__link[href$="00_config.html"]').first.click()
    page.wait_for_url('**/00_config.html')
    assert page.url == (docs_dir / '00_config.html').as_uri() and 'EngineConfig' in page.text_content('article')
