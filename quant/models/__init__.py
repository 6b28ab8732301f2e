"""Models used by the quantization and fusion case studies (torch.fx paper §6.2)."""

from quant.models.deeprec import DeepRecommender, masked_mse, rmse, train_deeprec
from quant.models.digits_cnn import DigitsCNN, accuracy, load_digits_tensors, train_digits_cnn

__all__ = [
    "DeepRecommender", "masked_mse", "rmse", "train_deeprec",
    "DigitsCNN", "accuracy", "load_digits_tensors", "train_digits_cnn",
]
