"""The fast paths' switches: one reading of the environment, and the docs' table is the code's."""

from __future__ import annotations

from pathlib import Path

from minicb.fastpaths.settings import SWITCHES, Settings, markdown_table

ROOT = Path(__file__).resolve().parents[2]


def test_every_switch_is_read_and_defaults_are_the_automatic_choices(tmp_path):
    s = Settings.from_env({"XDG_CACHE_HOME": str(tmp_path)})
    assert s == Settings(cache_dir=str(tmp_path / "minicb"))
    env = {"MINICB_LINEAR": "mkl", "MINICB_SKINNY_ROWS": "0", "MINICB_BLOCK_ROWS": "5",
           "MINICB_INT8_PRODUCTS": "1", "MINICB_FUSED_OPS": "0",
           "MINICB_LAYER_STACK": "0", "MINICB_HUGE_PAGES": "0", "MINICB_PACKED_LM_HEAD": "0",
           "MINICB_GREEDY_HEAD": "0", "MINICB_BF16_DECODE": "widen", "MINICB_PROMPT_ATTENTION": "sdpa",
           "MINICB_CACHE_DIR": "/k", "CC": "gcc-12"}
    assert {var for var, *_ in SWITCHES} == set(env)          # the table names every switch read
    assert Settings.from_env(env) == Settings(
        linear="mkl", skinny_rows="0", block_rows="5", int8_products="1", fused_ops=False, layer_stack=False,
        huge_pages=False, packed_lm_head=False, greedy_head=False, bf16_decode="widen",
        prompt_attention="sdpa", cache_dir="/k", cc="gcc-12")
    assert Settings.from_env({"MINICB_FUSED_OPS": "no"}).fused_ops      # only "0" turns a switch off


def test_the_docs_table_is_the_settings_table():
    page = (ROOT / "docs" / "appendix" / "fast_paths_switches.md").read_text()
    assert markdown_table() in page
