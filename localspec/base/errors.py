"""The one exception type a user may see: its message is printed as a single line, no traceback."""


class LocalspecError(Exception):
    """A problem the user can act on (bad option, unknown model, prompt too long, ...)."""


_OOM_WORDS = ("out of memory", "not enough memory", "can't allocate memory", "cannot allocate memory")


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether `exc` says memory ran out, in any of its forms: MemoryError, torch.OutOfMemoryError
    (CUDA, MPS), or the RuntimeError torch's CPU allocator raises ("DefaultCPUAllocator: can't
    allocate memory"). Matched by name and message, so this module needs no torch."""
    if isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError":
        return True
    return isinstance(exc, RuntimeError) and any(word in str(exc).lower() for word in _OOM_WORDS)


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (its type's name when it has none): what a user sees."""
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
