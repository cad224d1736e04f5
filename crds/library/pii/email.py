import re

EMAIL = re.compile(r"(?<![\w.+%-])[A-Za-z0-9._%+-]+@[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?)*\.[A-Za-z]{2,24}(?![\w-])")


def find(text, settings):
    return [(m.start(), m.end(), "email") for m in EMAIL.finditer(text)]


def execute(context, settings):
    return _masked(context, settings, find)
