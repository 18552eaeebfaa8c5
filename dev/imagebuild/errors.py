"""The one error imagebuild raises: its message says what failed and how to fix it."""


class ImageBuildError(RuntimeError):
    pass
