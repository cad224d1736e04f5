import unicodedata

# Writing systems, by the first word of a letter's Unicode name.
SCRIPTS = {
    "LATIN": "latin", "CYRILLIC": "cyrillic", "GREEK": "greek", "ARABIC": "arabic", "HEBREW": "hebrew",
    "CJK": "han", "HIRAGANA": "kana", "KATAKANA": "kana", "HANGUL": "hangul", "DEVANAGARI": "devanagari",
    "THAI": "thai", "ARMENIAN": "armenian", "GEORGIAN": "georgian", "BENGALI": "bengali", "TAMIL": "tamil",
}


def script_of(ch):
    name = unicodedata.name(ch, "")
    return SCRIPTS.get(name.split(" ", 1)[0], "other")


def execute(context, settings):
    allowed = set(settings["allowed"])
    least = int(_setting(settings, "min_letters", 20))
    share = float(_setting(settings, "max_other_share", 0.1))
    counts = {}

    def count(text):
        for ch in text:
            if ch.isalpha():
                s = script_of(ch)
                counts[s] = counts.get(s, 0) + 1
        return text

    _walk(context["outgoing"], count)
    letters = sum(counts.values())
    other = {s: n for s, n in counts.items() if s not in allowed}
    if letters < least or sum(other.values()) <= share * letters:
        return {"action": "pass"}
    findings = {"letters": letters, "other_scripts": dict(sorted(other.items()))}
    message = _setting(settings, "message", "The message was not sent: it is written in a script this assistant does not serve.")
    return _answer(context["outgoing"], findings, message)
