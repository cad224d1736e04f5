import re

# 13 to 19 digits, alone or in groups split by spaces or dashes, that pass the Luhn check.
CANDIDATE = re.compile(r"(?<![\d\-])\d(?:[ \-]?\d){12,18}(?![\d\-])")


def luhn(digits):
    total = 0
    for i, d in enumerate(reversed(digits)):
        n = int(d)
        if i % 2:
            n = n * 2 - 9 if n > 4 else n * 2
        total += n
    return total % 10 == 0


def find(text, settings):
    spans = []
    for m in CANDIDATE.finditer(text):
        digits = [c for c in m.group() if c.isdigit()]
        if luhn(digits) and len(set(digits)) > 1:
            spans.append((m.start(), m.end(), "card"))
    return spans


def execute(context, settings):
    return _masked(context, settings, find)
