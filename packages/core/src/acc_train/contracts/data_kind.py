"""The contract of a kind of training example (``data.kind``): which fields a row holds and how
it becomes tokens, with the tokens that count in the loss marked.

Core registers ``text``, ``prompt_completion`` and ``chat`` (:mod:`acc_train.data.kinds`); a
plugin adds its own through ``acc_train_register_data_kinds`` (``docs/hooks.md``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from acc_train.contracts.protocols import Section

__all__ = ["DataKind", "Tokenized"]

#: what :meth:`DataKind.tokenize` returns: per example, its token ids (``"input_ids"``) and one
#: flag per token (``"loss_mask"``, 1 where the token counts in the loss, 0 where it is context;
#: leave ``"loss_mask"`` out when every token counts)
Tokenized = dict[str, list[list[int]]]


class DataKind(ABC):
    """A kind of training example.

    Instances are pickled into ``datasets.map`` worker processes: keep them plain (no open
    files, no tokenizer held), and everything :meth:`tokenize` needs in its arguments.
    """

    #: the value of ``data.kind`` that selects it
    name: ClassVar[str]
    description: ClassVar[str] = ""
    #: True: documents are joined and cut into ``data.seq_len`` rows wherever the cut falls
    #: (pretraining text; ``data.overlong`` does not apply). False: an example is kept whole in
    #: one row, and one longer than ``seq_len`` is truncated or dropped (``data.overlong``).
    continuous: ClassVar[bool] = False
    #: True when packing is the default for this kind (``data.packing`` not set)
    packs_by_default: ClassVar[bool] = False

    def all_names(self) -> list[str]:
        return [self.name]

    @abstractmethod
    def fields(self, cfg: Section) -> list[str]:
        """The fields (columns) every row must have, as ``cfg`` names them."""

    def check_row(self, row: dict[str, Any], cfg: Section) -> str | None:
        """What is wrong with one row of a data file, or None. Called before launch for each
        JSON line (its line number is added to the message). The default checks that every
        field of :meth:`fields` is present and a string."""
        for field in self.fields(cfg):
            if field not in row:
                return f"has no field {field!r}"
            if not isinstance(row[field], str):
                return f"field {field!r} is a {type(row[field]).__name__}, not a string"
        return None

    def check_tokenizer(self, tokenizer: Any, cfg: Section) -> None:
        """Raise :class:`acc_train.errors.UserError` when ``tokenizer`` cannot serve this kind
        (``None`` is the demo job's byte-level vocabulary). Called before launch."""

    @abstractmethod
    def tokenize(self, batch: dict[str, list[Any]], tokenizer: Any, cfg: Section) -> Tokenized:
        """Token ids and loss flags of a batch of rows (``batch[field][i]`` is row i's value),
        at full length: truncation, dropping and packing are the pipeline's. A row may give an
        empty example (no tokens): it is skipped and counted."""
