"""`--reward-model LOCAL_DIR`: a local HF sequence-classification model as a reward. Never downloaded: the
directory must hold the model (config.json, weights, tokenizer with a chat template) and every load passes
local_files_only=True; the model's own Python code runs only with trust_remote_code=True, an explicit flag.

transformers is optional (it is not a dependency of training); it is imported when a reward model is loaded,
as the optional wandb and matplotlib are, and its absence is a NanoforgeError saying what to install."""
import os
from pathlib import Path

import torch

from nanoforge.core.errors import NanoforgeError


class RewardModel:
    """A loaded reward model: `score(prompt_messages, reply)` is the model's one logit for the conversation
    rendered by its own chat template (prompt messages + the reply as the assistant turn)."""

    def __init__(self, model, tokenizer, path: Path, max_tokens: int = 2048):
        self.model, self.tokenizer, self.path, self.max_tokens = model, tokenizer, path, max_tokens

    @torch.no_grad()
    def score(self, prompt_messages: list[dict], reply: str) -> float:
        """The score logit of `reply` to the conversation; a rendering over max_tokens keeps its end (the
        model reads its score at the last token)."""
        messages = list(prompt_messages) + [{"role": "assistant", "content": reply}]
        text = self.tokenizer.apply_chat_template(messages, tokenize=False)
        ids = self.tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]  # (1, T)
        ids = ids[:, -self.max_tokens:].to(self.model.device)
        return float(self.model(input_ids=ids).logits[0, 0].float())

    def reward(self, completion: str, record: dict) -> float:
        """As a reward function (rl/rewards.py): the score of the completion to the record's messages."""
        return self.score(record["messages"], completion)


def load_reward_model(path: str | os.PathLike, trust_remote_code: bool = False, device: str = "cpu",
                      max_tokens: int = 2048) -> RewardModel:
    """A local AutoModelForSequenceClassification + AutoTokenizer directory -> RewardModel (eval mode, on
    `device`); a clear NanoforgeError when the directory is missing, not a model, or not a one-score model."""
    path = Path(path)
    where = f"--reward-model {path}"
    if not path.is_dir():
        raise NanoforgeError(f"{where}: no such directory (a local HF sequence-classification model directory; "
                             "reward models are never downloaded)")
    if not (path / "config.json").is_file():
        raise NanoforgeError(f"{where}: has no config.json, so it is not an HF model directory")
    try:
        import transformers
    except ImportError:
        raise NanoforgeError("--reward-model needs the transformers package (pip install transformers)") from None
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True,
                                                               trust_remote_code=trust_remote_code)
        model = transformers.AutoModelForSequenceClassification.from_pretrained(
            path, local_files_only=True, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, KeyError) as e:
        hint = (" (the model ships its own code: allow it explicitly with trust_remote_code, only for a model "
                "you trust)" if "trust_remote_code" in str(e) and not trust_remote_code else "")
        raise NanoforgeError(f"{where}: cannot be loaded as a sequence-classification model: {e}{hint}") from None
    if model.config.num_labels != 1:
        raise NanoforgeError(f"{where}: has {model.config.num_labels} labels; a reward model gives one score "
                             "(num_labels 1)")
    if not tokenizer.chat_template:
        raise NanoforgeError(f"{where}: its tokenizer has no chat template, so a conversation cannot be rendered "
                             "the way the model was trained on")
    return RewardModel(model.eval().to(device), tokenizer, path, max_tokens)
