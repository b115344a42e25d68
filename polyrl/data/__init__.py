"""Data: verl-schema parquet prompts (RL), prompt/response or messages (SFT), synthetic tasks, GSM8K conversion."""

from polyrl.data.config import DataConfig
from polyrl.data.dataset import PromptSampler, RLSample, load_rl_dataset, read_parquet_rows, write_parquet
from polyrl.data.sft import SFTSample, load_sft_dataset
from polyrl.data.synthetic import TASKS, make_rows

__all__ = ["DataConfig", "PromptSampler", "RLSample", "SFTSample", "TASKS", "load_rl_dataset", "load_sft_dataset",
           "make_rows", "read_parquet_rows", "write_parquet"]
