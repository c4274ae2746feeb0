"""Dataset rows -> the step's prompts and preference pairs: ``processor`` (RLDataProcessor: prompts
chat-templated and tokenized within max_prompt_length; preference pairs), ``sources`` (a dataset source
as rows), ``readers`` (dataset files read within bounds, the rows' shape checked), ``preference`` (TRL's
preference row formats), ``sft_data`` (SFT's rows as tokens), ``images`` (a prompt's images).

The names below are the package's import path for the other rooms (the records' too:
``from verl_fast.data import PromptRow``).
"""

from verl_fast.data.preference import preference_parts
from verl_fast.data.processor import OVERLONG_PROMPTS, RLDataProcessor
from verl_fast.data.sources import hub_rows, load_rows
from verl_fast.records.prompts import PreferencePair, PromptBatch, PromptRow

__all__ = ["OVERLONG_PROMPTS", "PreferencePair", "PromptBatch", "PromptRow", "RLDataProcessor", "hub_rows", "load_rows",
           "preference_parts"]
