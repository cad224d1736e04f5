import ipaddress
import re

V4 = re.compile(r"(?<![\w.])(?:\d{1,3}\.){3}\d{1,3}(?![\w]|\.\d)")
V6 = re.compile(r"(?<![\w:.])(?:[0-9A-Fa-f]{0,4}:){2,7}(?:[0-9A-Fa-f]{0,4}|(?:\d{1,3}\.){3}\d{1,3})(?![\w:])")


def find(text, settings):
    versions = set(_setting(settings, "versions", [4, 6]))
    private = _setting(settings, "private", True)
    spans = []
    for version, pattern in ((4, V4), (6, V6)):
        if version not in versions:
            continue
        for m in pattern.finditer(text):
            try:
                address = ipaddress.ip_address(m.group())
            except ValueError:
                continue
            if private or address.is_global:
                spans.append((m.start(), m.end(), "ip"))
    return spans


def execute(context, settings):
    return _masked(context, settings, find)
