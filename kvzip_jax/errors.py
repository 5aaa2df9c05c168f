"""Named errors raised early on bad input, so users never see a traceback from inside XLA."""


class KvzipError(Exception):
    """Base class of every error kvzip-jax raises on purpose."""


class ModelFileError(KvzipError):
    """A model file or folder is missing, unreadable or corrupt."""


class UnsupportedArchitectureError(KvzipError):
    """The checkpoint's architecture is not one kvzip-jax implements."""


class WeightShapeError(KvzipError):
    """A tensor in a checkpoint has the wrong shape, is missing, or is unexpected."""


class ContextTooLongError(KvzipError):
    """The input does not fit the model's maximum context or the cache capacity."""


class EmptyInputError(KvzipError):
    """An empty prompt, context or batch was given."""


class ChecksumError(ModelFileError):
    """An assembled model file does not have the expected sha256."""


class TaskFileError(KvzipError):
    """A task file (JSONL of contexts, questions and answers) is missing or malformed."""


class DatasetFileError(TaskFileError):
    """A dataset in kvpress's format (a parquet or JSONL file, or a hub name) is missing, unreadable or malformed."""


class RulerDataMissingError(TaskFileError):
    """A RULER task's outside data set (SQuAD v2.0 dev for ruler_qa_1, HotpotQA dev distractor for ruler_qa_2) is
    not given, or not where it was said to be."""
