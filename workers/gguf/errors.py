"""The one error of GGUF reading: a file shoal cannot serve, named with the reason."""


class GGUFError(ValueError):
    """A GGUF file that cannot be served: unknown architecture, unsupported tensor type,
    missing metadata or a corrupt file. The message names the file and what is wrong."""
