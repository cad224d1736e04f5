import re

# An international number (+ and a country code) or a national one written in groups, e.g.
# +44 20 7946 0958, +1 (415) 555-2671, 010-1234-5678, (030) 1234 5678, 415.555.2671.
INTERNATIONAL = re.compile(r"(?<![\w+])\+\d{1,3}(?:[ .\-]?\(?\d{1,5}\)?){1,6}(?![\w])")
# Three groups and no more: four groups of digits are a card or an account, not a phone number.
NATIONAL = re.compile(r"(?<![\w+.\-])(?<!\d[ .\-])\(?\d{2,5}\)?[ .\-]\d{3,4}[ .\-]\d{3,5}(?![\w.\-])(?![ .\-]\d)")


def find(text, settings):
    least = int(_setting(settings, "min_digits", 8))
    patterns = [INTERNATIONAL] if _setting(settings, "international_only", False) else [INTERNATIONAL, NATIONAL]
    spans = []
    for pattern in patterns:
        for m in pattern.finditer(text):
            digits = sum(c.isdigit() for c in m.group())
            if least <= digits <= 15:
                spans.append((m.start(), m.end(), "phone"))
    return spans


def execute(context, settings):
    return _masked(context, settings, find)
