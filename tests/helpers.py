"""Helpers shared by several test modules (`tests/` is on `sys.path` under pytest: `from helpers import ...`)."""
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def rel_err(a, b) -> float:
    "`||a - b|| / ||b||` in fp32."
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def bench_model_dir(model: str, shrink: dict | None = None) -> Path:
    "A folder with `conf/model/<model>.yaml`'s config.json (as `bench.sweep.model_dir` writes it), `shrink` applied."
    import yaml
    from transformers import AutoConfig
    hf = dict(yaml.safe_load((ROOT / 'conf/model' / f'{model}.yaml').read_text())['hf_config'])
    hf.update(shrink or {})
    d = Path(tempfile.mkdtemp())
    AutoConfig.for_model(hf.pop('model_type'), **hf).save_pretrained(d)
    return d


def tiny_tokenizer(vocab_size: int):
    "A word-level tokenizer over `vocab_size` ids (`<unk>`, `w1`, `w2`, ...), built offline: no model download."
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.WordLevel({'<unk>': 0, **{f'w{i}': i for i in range(1, vocab_size)}}, unk_token='<unk>'))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token='<unk>')
