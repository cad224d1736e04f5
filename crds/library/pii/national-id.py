import re

DNI_LETTERS = "TRWAGMYFPDXBNJZSQVHLCKE"


def us_ssn(text):
    pattern = r"(?<![\d\-])(?!000|666|9\d\d)\d{3}-(?!00)\d{2}-(?!0000)\d{4}(?![\d\-])"
    return [(m.start(), m.end()) for m in re.finditer(pattern, text)]


def uk_nino(text):
    pattern = r"(?<![A-Za-z0-9])(?!BG|GB|NK|KN|NT|TN|ZZ)[A-CEGHJ-PR-TW-Z][A-CEGHJ-NPR-TW-Z] ?\d{2} ?\d{2} ?\d{2} ?[A-D](?![A-Za-z0-9])"
    return [(m.start(), m.end()) for m in re.finditer(pattern, text)]


def es_dni(text):
    spans = []
    for m in re.finditer(r"(?<![A-Za-z0-9])(\d{8})-?([A-Za-z])(?![A-Za-z0-9])", text):
        if DNI_LETTERS[int(m.group(1)) % 23] == m.group(2).upper():
            spans.append((m.start(), m.end()))
    return spans


KINDS = {"us_ssn": us_ssn, "uk_nino": uk_nino, "es_dni": es_dni}


def find(text, settings):
    spans = []
    for kind in settings["ids"]:
        spans.extend((s, e, kind) for s, e in KINDS[kind](text))
    return spans


def execute(context, settings):
    return _masked(context, settings, find)
