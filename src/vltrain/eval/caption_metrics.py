"""Caption metrics: BLEU-1..4 and CIDEr-D as the COCO caption evaluation (``pycocoevalcap``) gives them.

Captioning papers report the numbers of ``pycocoevalcap``: its Stanford PTB tokenizer (a Java
subprocess), then its ``Bleu(4)`` and ``Cider`` scorers. A figure computed any other way is not
comparable, so this module reproduces those definitions exactly, in pure Python, so that a
training run can score captions in its evaluation loop without Java or a subprocess.
``tests/eval/test_caption_metrics.py`` holds it to the package itself.

- ``ptb_tokenize``: the PTB tokenization of Stanford CoreNLP 3.4.1's ``PTBLexer`` (the jar that
  ``pycocoevalcap`` ships; run as ``-preserveLines -lowerCase``), then the punctuation
  ``pycocoevalcap`` removes. The lexer takes, at each point, the longest match over its rules
  (trailing context included), the earliest rule on a tie; the rules below are its rules, in its
  order, written from its specification.
- ``bleu``: Papineni et al. (2002), corpus-level, with the reference length closest to each
  candidate's and ``pycocoevalcap``'s 1e-9 / 1e-15 guards against empty counts.
- ``cider_d``: Vedantam et al. (2015), CIDEr-D: tf-idf n-grams (1..4) with document frequencies
  from the evaluated images' references, candidate weights clipped by the reference's, a Gaussian
  length penalty (sigma 6), averaged over n and references, times 10.
"""

from __future__ import annotations

import functools
import math
import re
import unicodedata
from collections import Counter
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import NamedTuple

from vltrain.errors import DataError

PUNCTUATION = frozenset(["''", "'", "``", "`", "-LRB-", "-RRB-", "-LCB-", "-RCB-",
                         ".", "?", "!", ",", ":", "-", "--", "...", ";"])
"""What ``pycocoevalcap`` drops after tokenizing. It compares the lower-cased tokens, so the bracket
names (``-lrb-``) are kept: a caption with parentheses keeps them as words, as the package does."""

_LETTER_EXTRA = (
    "\u00AD\u0237-\u024F\u02C2-\u02C5\u02D2-\u02DF\u02E5-\u02FF\u0300-\u036F\u0370-\u037D\u0384\u0385"
    "\u03CF\u03F6\u03FC-\u03FF\u0483-\u0487\u04CF\u04F6-\u04FF\u0510-\u0525\u055A-\u055F\u0591-\u05BD"
    "\u05BF\u05C1\u05C2\u05C4\u05C5\u05C7\u0615-\u061A\u063B-\u063F\u064B-\u065E\u0670\u06D6-\u06EF"
    "\u06FA-\u06FF\u070F\u0711\u0730-\u074F\u0750-\u077F\u07A6-\u07B1\u07CA-\u07F5\u07FA\u0900-\u0903"
    "\u093C\u093E-\u094E\u0951-\u0955\u0962-\u0963\u0981-\u0983\u09BC-\u09C4\u09C7\u09C8\u09CB-\u09CD"
    "\u09D7\u09E2\u09E3\u0A01-\u0A03\u0A3C\u0A3E-\u0A4F\u0A81-\u0A83\u0ABC-\u0ACF\u0B82\u0BBE-\u0BC2"
    "\u0BC6-\u0BC8\u0BCA-\u0BCD\u0C01-\u0C03\u0C3E-\u0C56\u0D3E-\u0D44\u0D46-\u0D48\u0E30-\u0E3A"
    "\u0E47-\u0E4E\u0EB1-\u0EBC\u0EC8-\u0ECD")
"""Marks the lexer counts as letters besides Java's ``isLetter``."""

_MISC_SYMBOL = (
    r"[+%&~\^|\\\u00A6\u00A7\u00A8\u00A9\u00AC\u00AE\u00AF\u00B0-\u00BA\u00D7\u00F7\u0387\u05BE\u05C0"
    r"\u05C3\u05C6\u05F3\u05F4\u0600-\u0603\u0606-\u060A\u060C\u0614\u061B\u061E\u066A\u066D\u0703-\u070D"
    r"\u07F6-\u07F8\u0964\u0965\u0E4F\u1FBD\u2016\u2017\u2020-\u2023\u2030-\u2038\u203B\u203E-\u2042"
    r"\u2044\u207A-\u207F\u208A-\u208E\u2100-\u214F\u2190-\u21FF\u2200-\u2BFF\u3012\u30FB\uFF01-\uFF0F"
    r"\uFF1A-\uFF20\uFF3B-\uFF40\uFF5B-\uFF65]")


def _char_class(keep: Callable[[str], bool]) -> str:
    """The characters of the Basic Multilingual Plane that ``keep`` accepts, as ranges for a class:
    the Java lexer reads UTF-16 units, so a character beyond the plane is none of its classes."""
    ranges, start = [], None
    for code in range(0x10001):
        if code < 0x10000 and keep(chr(code)):
            start = code if start is None else start
        elif start is not None:
            ranges.append(f"\\u{start:04X}" + (f"-\\u{code - 1:04X}" if code - 1 > start else ""))
            start = None
    return "".join(ranges)


class _Macros(NamedTuple):
    """The lexer's building blocks. Character classes match case-sensitively and literal words
    case-insensitively, as they do in the JFlex specification (``%caseless``)."""

    let: str  # Java's [:letter:]
    letter: str  # the lexer's LETTER: [:letter:], a few marks, and &aacute;-style entities
    upper: str
    word: str
    apos: str
    apos_etc: str
    acro: tuple[str, ...]
    sgml: str


def _macros() -> _Macros:
    letters = _char_class(lambda c: unicodedata.category(c).startswith("L"))
    let = f"[{letters}]"
    letter = f"(?:[{letters}{_LETTER_EXTRA}]|&[aeiouAEIOU](?i:acute|grave|uml);)"
    return _Macros(
        let=let, letter=letter, upper=f"[{_char_class(str.isupper)}]",
        word=rf"{letter}(?:{letter}|\d)*(?:[.!?]{letter}(?:{letter}|\d)*)*",
        apos=r"(?:['\u0092\u2019]|(?i:&apos;))", apos_etc=r"(?:['\u0092\u2019`\u0091\u2018\u201B]|(?i:&apos;))",
        acro=(r"[A-Za-z](?:\.[A-Za-z])*", r"(?i:canada|sino|korean|eu|japan|non)-(?i:u\.s)",
              r"(?i:u\.s\.-(?:u\.k|u\.s\.s\.r))"),
        sgml=(r"<(?:[!?][A-Za-z\-][^>\r\n]*|[A-Za-z][A-Za-z0-9_:.\-]*(?:[ ]+(?:[A-Za-z][A-Za-z0-9_:.\-]*"
              r"|[A-Za-z][A-Za-z0-9_:.\-]*[ ]*=[ ]*(?:'[^']*'|\"[^\"]*\")))*[ ]*/?|/[A-Za-z][A-Za-z0-9_:.\-]*)[ ]*>"))


class _Rule(NamedTuple):
    """One lexer rule: its alternatives, the trailing context it needs (not consumed, but counted
    in the match length), and what it makes of the text: ``(token or None, characters consumed)``."""

    alternatives: tuple[str, ...]
    context: str
    act: Callable[[str], tuple[str | None, int]]
    longest: bool  # a pattern whose greedy match is not always its longest: every end is tried


def _latex_quotes(text: str, left: bool) -> str:
    text = re.sub(r"&apos;|'", "`" if left else "'", text)
    text = re.sub(r"\"|&quot;", "``" if left else "''", text)
    for chars, quote in (("\u0091\u2018\u201B\u2039", "`"), ("\u0092\u2019\u203A", "'"),
                         ("\u0093\u201C\u00AB", "``"), ("\u0094\u201D\u00BB", "''")):
        text = re.sub(f"[{chars}]", quote, text)
    return text


def _keep(text: str) -> tuple[str, int]:
    return text.replace("\u00AD", "") or "-", len(text)


def _const(token: str | None) -> Callable[[str], tuple[str | None, int]]:
    return lambda text: (token, len(text))


def _pushback(count: int) -> Callable[[str], tuple[str, int]]:
    """A token less its last ``count`` characters, which are read again (``cannot``: can, not)."""
    return lambda text: (text[:-count], len(text) - count)


def _parens(text: str) -> tuple[str, int]:
    return text.replace("(", "-LRB-").replace(")", "-RRB-"), len(text)


_ACT = {
    "keep": _keep,
    "raw": lambda text: (text, len(text)),
    "amp": lambda text: (re.sub("(?i:&amp;)", "&", text), len(text)),
    "quote": lambda text: (_latex_quotes(text, False), len(text)),
    "left_quote": lambda text: (_latex_quotes(text, True), len(text)),
    "period_again": lambda text: (text, len(text) - 1),  # "etc." then "." once more
    "acronym": lambda text: (text[0], 1) if len(text) == 2 else (text, len(text) - 1),
    "hyphens": lambda text: ("--" if 3 <= len(text) <= 4 else text, len(text)),
    "spaced": lambda text: (text.replace(" ", "\u00A0"), len(text)),
    "phone": lambda text: _parens(text.replace(" ", "\u00A0")),
    "parens": _parens,
    "fraction": lambda text: ({"\u00BC": "1/4", "\u00BD": "1/2", "\u00BE": "3/4", "\u2153": "1/3",
                               "\u2154": "2/3"}.get(text, text), 1),
    "currency": lambda text: ({"\u00A2": "cents", "\u00A3": "#"}.get(text, "$" if text in
                              "\u0080\u00A4\u20A0\u20AC" else text), 1),
    "dquote": lambda text: ("''", len(text)), "left_dquote": lambda text: ("``", len(text)),
    "skip": _const(None),
}


def _rule(act: str | Callable, *alternatives: str, context: str = "", longest: bool = False) -> _Rule:
    return _Rule(alternatives, context, _ACT[act] if isinstance(act, str) else act, longest)


def _word_rules(m: _Macros) -> list[_Rule]:
    """From the top of the specification to the URLs: words, their clitics and the assimilations."""
    let, ae = m.let, m.apos_etc
    return [
        _rule("raw", r"(?i:c\+\+|[cf]#)"),
        _rule(_pushback(3), "(?i:cannot)"), _rule(_pushback(3), "'(?i:twas)"), _rule(_pushback(2), "'(?i:tis)"),
        _rule(_pushback(2), "(?i:gonna|gotta|lemme|gimme|wanna)"),
        _rule("spaced", m.sgml),
        _rule(_const("--"), r"&(?i:md|mdash|ndash);", "[\u0096\u0097\u2013-\u2015]"),
        _rule("amp", "(?i:&amp;)"), _rule("raw", r"&(?i:ht|tl|ur|lr|qc|ql|qr|odq|cdq|#[0-9]+);"),
        _rule("keep", m.word, context=rf"{m.apos}(?:[msdMSD]|(?i:re|ve|ll))"),
        _rule("keep", "[A-Za-z\u00AD]*[A-MO-Za-mo-z]\u00AD*", context=f"[nN]{ae}[tT]"),
        _rule("keep", m.word),
        _rule("raw", f"{m.apos}[nN]{m.apos}?", f"[lLdDjJ]{m.apos}", f"(?i:dunkin|somethin|ol){m.apos}",
              f"{m.apos}(?i:em)", f"[A-HJ-XZn]{ae}{let}{{2}}{let}*", f"{m.apos}[2-9]0(?i:s)",
              f"{m.apos}(?i:till?)", f"{let}+[aeiouyAEIOUY]{ae}[aeiouA-Z]{let}*", f"{m.apos}(?i:cause)",
              r"(?i:cont'd)\.?", "(?i:'twas|nor'easter|c'mon|e'er|s'mores|ev'ry|li'l|nat'l)", f"(?i:o){ae}(?i:o)"),
        _rule("raw", f"(?i:y){m.apos}", context=let),
    ]


def _web_and_number_rules(m: _Macros) -> list[_Rule]:
    """URLs, e-mail, handles, clitics standing alone, dates, numbers, fractions, money."""
    path = r"(?:/[^ \t\n\f\r\"<>|()]+[^ \t\n\f\r\"<>|.!?(){},-])?"
    no_dot = r"[^ \t\n\f\r\"<>|(){}.\u00A0]+"
    digit4 = r"\d{1,4}"
    return [
        _rule("raw", r"(?i:https?)://[^ \t\n\f\r\"<>|(){}]+[^ \t\n\f\r\"<>|.!?(){},-]"),
        _rule("raw", r"(?i:www)\.(?:[^ \t\n\f\r\"<>|.!?(){},]+\.)+[a-zA-Z]{2,4}" + path,
              r"(?:[^ \t\n\f\r\"`'<>|.!?(){},-_$]+\.)+(?i:com|net|org|edu)" + path),
        _rule("raw", rf"(?:(?i:&lt;)|<)?[a-zA-Z0-9][^ \t\n\f\r\"<>|()\u00A0{{}}]*@(?:{no_dot}\.)*{no_dot}"
                     r"(?:(?i:&gt;)|>)?"),
        _rule("raw", r"@[a-zA-Z_][a-zA-Z_0-9]*", f"#{m.letter}+"),
        _rule("quote", rf"{m.apos}(?:[msdMSD]|(?i:re|ve|ll))", f"[nN]{m.apos_etc}[tT]", context="[^A-Za-z]"),
        _rule("raw", r"\d{1,2}[\-/]\d{1,2}[\-/]\d{2,4}"),
        _rule("keep", r"[\-+]?\d*(?:[.:,\u00AD\u066B\u066C]\d+)+", r"[\-+]?\d+"),
        _rule("raw", "[\u207A\u207B\u208A\u208B]?(?:[\u2070\u00B9\u00B2\u00B3\u2074-\u2079]+|[\u2080-\u2089]+)"),
        _rule("spaced", f"(?:{digit4}[- \u00A0])?{digit4}(?:\\\\?/|\u2044){digit4}"),
        _rule("fraction", "[\u00BC\u00BD\u00BE\u2153-\u215E]"),
        _rule("amp", r"-(?i:rrb|lrb|rcb|lcb|rsb|lsb)-", r"(?i:c\.d\.s|pro-|anti-)",
              r"(?i:s)(?:&|(?i:&amp;))(?i:p-500|ls)", f"(?i:cap){m.apos}(?i:n)", f"(?i:c){m.apos}(?i:est)"),
        _rule("raw", r"[A-Za-z0-9]+(?:-[A-Za-z]+){0,2}(?:\\?/[A-Za-z0-9]+(?:-[A-Za-z]+){0,2}){1,2}"),
        _rule("raw", r"[A-Z]*\$|#"),
        _rule("currency", "[\u00A2-\u00A5\u0080\u20A0\u20AC\u060B\u0E3F\u20A4\uFFE0\uFFE1\uFFE5\uFFE6]"),
    ]


_ABBREV1 = (
    "(?:(?i:jan|feb|mar|apr|jun|jul|aug|sept?|oct|nov|dec|mon|tues?|wed|thu|thurs|fri|ala|ariz|calif|colo"
    "|conn|ct|dak|fla|ga|ind|kans?|ky|md|mich|minn|mo|mont|neb|nev|okla|penn|tenn|va|vt|wisc?|wyo|inc|cos?"
    r"|corp|ltd|plc|rt|bancorp|bhd|assn|univ|intl|sys|tel|est|ext|sq|jr|sr|bros|ed\.d|ph\.d|blvd|rd|esq|etc"
    "|al|seq|bldg)|(?i:pp?t)[ye](?i:s?)|A(?i:z|rk)|D(?i:el)|I(?i:ll)|L(?i:a)|M(?i:ass|iss)|O(?i:re)|P(?i:a)"
    r"|T(?i:ex)|W(?i:ash))\.")
_ABBREV4 = (
    "(?:(?i:mrs?|ms|drs?|profs?|sens?|reps?|attys?|lt|col|gen|messrs|govs?|adm|rev|maj|sgt|cpl|pvt|capt|ste?"
    "|ave|pres|lieut|hon|brig|co?mdr|pfc|spc|supts?|det|mt|ft|adj|adv|asst|assoc|ens|insp|mlle|mme|msgr|sfc"
    r"|vs|alex|wm|jos|cie|a\.k\.a|cf|treas|ph|invt|elec|natl|dept)|M(?i:iss)|(?i:m)[ft](?i:g))")
_SENTENCE_STARTS = (
    "A(?i:bout|ccording|dditionally|fter|n|s|t)?|B(?i:ut)|E(?i:arlier)|H(?i:e|er|ere|owever)|I(?i:f|n|t)"
    r"|L(?i:ast)|M(?i:any|ore|r\.|s\.)|N(?i:ow)|O(?i:nce|ne|ther|ur)|S(?i:he|ince|o|ome|uch)"
    "|T(?i:hat|he|heir|hen|here|hese|hey|his)|W(?i:e|hen|hile|hat)|Y(?i:et|ou)")
_SPACE = "[ \t\u00A0\u2000-\u200A\u3000]"
_SPACENL = "[ \t\u00A0\u2000-\u200A\u3000\r\n\u2028\u2029\u000B\u000C\u0085]"


def _abbreviation_rules(m: _Macros) -> list[_Rule]:
    """Abbreviations and acronyms: whether their period ends the sentence too."""
    acronyms = tuple(a + r"\." for a in m.acro)
    starts = f"{_SPACENL}+(?:{_SENTENCE_STARTS}|{m.sgml}){_SPACENL}"
    return [
        _rule("acronym", *acronyms, context=starts),
        _rule("raw", r"(?i:ca|figs?|prop|nos?|art|bldg|pp|op)\.", context=rf"{_SPACENL}?\d"),
        _rule("raw", r"(?i:pt)[eyEY]\.", r"(?i:co)\.", context=f"{_SPACE}(?i:ltd|lim)"),
        _rule("period_again", _ABBREV1, context=f"{_SPACENL}(?:{_SPACENL}|{m.upper}|{m.sgml})"),
        _rule("raw", _ABBREV1, context=r"[\s\S]{2}"),
        _rule("period_again", _ABBREV1),
        _rule("raw", _ABBREV4 + r"\.", *acronyms),
        _rule("raw", _ABBREV4, *m.acro, context=_SPACE),
        _rule("raw", *m.acro, context=_SPACENL),
        _rule("raw", rf"{m.apos}\d\d", context=_SPACENL),
        _rule("raw", rf"(?:{m.letter}|\d)+(?:\.(?:{m.letter}|\d)+)*\.(?i:bat|bmp|c|class|cgi|cpp|dll|docx?|exe|gif|gz"
                     r"|h|html?|jar|java|jpeg|jpg|mov|mp3|pdf|php|pl|png|ppt|ps|py|sql|tar|txt|wav|x|xml|zip)",
              context=f"{_SPACENL}|[.?!,]"),
        _rule("keep", m.word + r"\.", context="[,;:\u3001]"),
    ]


def _symbol_rules(m: _Macros) -> list[_Rule]:
    """Phone numbers, quotes, smileys, brackets, dashes, dots, hyphenated words and the rest."""
    face = r"[\-\^x=~<>']"
    hthing = r"[A-Za-z0-9][A-Za-z0-9.,\u00AD]*(?:-(?:[A-Za-z](?:\.[A-Za-z])+\.|[A-Za-z0-9\u00AD]+))+"
    hyphen = "[-_\u058A\u2010\u2011]"
    part = f"(?:[dDoOlL]{m.apos_etc}(?:{m.let}|\\d))?(?:{m.let}|\\d)+"
    thinga = r"[A-Z]+(?:(?:[+&]|(?i:&amp;))[A-Z]+)+"
    return [
        _rule("phone", r"(?:\([0-9]{2,3}\)[ \u00A0]?|(?:\+\+?)?(?:[0-9]{2,4}[\- \u00A0])?[0-9]{2,4}[\- \u00A0])"
                       r"[0-9]{3,4}[\- \u00A0]?[0-9]{3,5}",
              r"(?:(?:\+\+?)?[0-9]{2,4}\.)?[0-9]{2,4}\.[0-9]{3,4}\.[0-9]{3,5}", longest=True),
        _rule("left_dquote", r"\"|(?i:&quot;)", context="[A-Za-z0-9$]"), _rule("dquote", r"\"|(?i:&quot;)"),
        _rule("skip", "\x7f"), _rule(_const("<"), "<|(?i:&lt;)"), _rule(_const(">"), ">|(?i:&gt;)"),
        _rule("parens", r"[<>]?[:;=][\-o*']?[()DPdpO\\{@|\[\]]", context="[^A-Za-z0-9]"),
        _rule("parens", r"[\^x=~<>]\.\[\^(?i:x)=~<>\]", f"{face}_{face}", rf"\({face}[_.]?{face}\)",
              r"\([\^x=~<>']-[\^x=~<>'`]\)"),
        _rule(_const("-LCB-"), r"\{"), _rule(_const("-RCB-"), r"\}"), _rule(_const("-LSB-"), r"\["),
        _rule(_const("-RSB-"), r"\]"), _rule(_const("-LRB-"), r"\("), _rule(_const("-RRB-"), r"\)"),
        _rule("hyphens", r"-+"),
        _rule(_const("..."), r"\.{3,5}", "(?:\\.[ \u00A0]){2,4}\\.", "[\u0085\u2026]"),
        _rule("raw", "@+", "#+", "_+"), _rule("raw", r"\*+", r"(?:\\\*){1,3}"),
        _rule("raw", "[,;:\u3001]"), _rule("raw", "[?!]+"),
        _rule("raw", "[.\u00A1\u00BF\u037E\u0589\u061F\u06D4\u0700-\u0702\u07FA\u3002]"),
        _rule("raw", "="), _rule("raw", "/"),
        _rule("keep", hthing + r"\.", context="[,;:\u3001]"), _rule("keep", hthing),
        _rule("raw", f"{part}(?:{hyphen}{part})*\\.", context="[,;:\u3001]"),
        _rule("raw", f"{part}(?:{hyphen}{part})*"),
        _rule("amp", thinga + r"\.", context="[,;:\u3001]"), _rule("amp", thinga),
        _rule("left_quote", "'", context="[A-Za-z][^ \t\n\r\u00A0]"),
        _rule("quote", rf"{m.apos}(?:[msdMSD]|(?i:re|ve|ll))", f"[nN]{m.apos_etc}[tT]"),
        _rule("quote", m.apos, "''", "[`\u2018\u2019\u201A\u201B\u201C\u201D\u0091-\u0094\u201E\u201F"
                                     "\u2039\u203A\u00AB\u00BB]{1,2}"),
        _rule("raw", "<<|>>"), _rule("raw", _MISC_SYMBOL),
        _rule("skip", f"\x00|{_SPACE}+|[\u200B\u200E\u200F\uFEFF]", _SPACENL, "(?i:&nbsp;)"),
    ]


class _Slot(NamedTuple):
    """Where one alternative's match lands in the lexer's one regex: its group, its context's."""

    act: Callable[[str], tuple[str | None, int]]
    group: int
    context: int  # 0: the rule has no trailing context
    longest: re.Pattern | None


class _Lexer(NamedTuple):
    """Every alternative of every rule as an optional lookahead of one regex, so one match call
    reports each one's match at a point: the rules are many and a caption's tokens few."""

    pattern: re.Pattern
    slots: tuple[_Slot, ...]


@functools.cache
def _lexer() -> _Lexer:
    """Built on first use (the letter classes take a pass over the 65,536 characters of the plane)."""
    m = _macros()
    parts, slots, group = [], [], 1
    for rule in _word_rules(m) + _web_and_number_rules(m) + _abbreviation_rules(m) + _symbol_rules(m):
        for alternative in rule.alternatives:
            parts.append(f"(?:(?=({alternative})" + (f"(?=({rule.context}))" if rule.context else "") + ")|)")
            slots.append(_Slot(rule.act, group, group + 1 if rule.context else 0,
                               re.compile(alternative) if rule.longest else None))
            group += 2 if rule.context else 1
    return _Lexer(re.compile("".join(parts)), tuple(slots))


_PLAIN = re.compile(r"(?P<space>[ \t\n]+)|(?P<word>[A-Za-z]+)(?=[,;:!?]*[ \t\n])"
                    r"|(?P<mark>[,;:]|[?!]+|\.(?![ \t\n]\.))(?=[ \t\n])")
"""What most of a caption is, read without trying every rule: spaces; an ASCII word before a space
(perhaps through , ; : ! ?), which every rule takes as itself or not at all, bar ``_SPLIT_WORDS``;
and a mark before a space (a period not followed by ``. .``, which would be an ellipsis)."""
_SPLIT_WORDS = frozenset(["cannot", "gonna", "gotta", "lemme", "gimme", "wanna"])


def _longest_end(pattern: re.Pattern, text: str, at: int, end: int) -> int:
    """The longest match of a phone number, whose greedy match can stop short (an optional part
    taken early): every end up to 32 characters, longer than any it matches, longest first."""
    return next((e for e in range(min(len(text), at + 32), end, -1) if pattern.fullmatch(text, at, e)), end)


def _next_token(lexer: _Lexer, text: str, at: int) -> tuple[str | None, int]:
    """The longest match over the rules at ``at`` (trailing context counted), the first rule on a
    tie; a character no rule takes is dropped, as the Java lexer drops it."""
    regs = lexer.pattern.match(text, at).regs
    best, chosen = at, None
    for slot in lexer.slots:
        end = regs[slot.group][1]
        if end <= at:
            continue
        if slot.longest is not None:
            end = _longest_end(slot.longest, text, at, end)
        total = max(end, regs[slot.context][1]) if slot.context else end
        if total > best:
            best, chosen = total, (slot.act, end)
    if chosen is None:
        return None, 1
    return chosen[0](text[at:chosen[1]])


def _lex(text: str) -> list[str]:
    lexer, tokens, at = _lexer(), [], 0
    while at < len(text):
        plain = _PLAIN.match(text, at)
        if plain and not (plain.lastgroup == "word" and plain.group().lower() in _SPLIT_WORDS):
            token, consumed = (None if plain.lastgroup == "space" else plain.group()), plain.end() - at
        else:
            token, consumed = _next_token(lexer, text, at)
        if token is not None:
            tokens.append(token)
        at += consumed
    return tokens


def ptb_tokenize(text: str) -> str:
    """One caption as ``pycocoevalcap``'s ``PTBTokenizer`` gives it: PTB tokens, lower-cased, its
    punctuation removed, joined by single spaces.

    ``pycocoevalcap`` tokenizes a set's captions as the lines of one file, and a few rules look past
    a line's end; a caption is read here as a line with a newline after it and nothing more. So the
    next caption can make Java differ: a caption ending in a one-letter abbreviation before one that
    starts "The", "A", ... ("vitamin C." gives "c" there, "c." here); one ending in "no.", "fig." and
    the like before one starting with a digit ("no." there, "no" here); the last of a batch ending
    in ":)" or "'90". Line breaks other than "\n" (\r, \u2028, ...) are read as spaces: Java splits
    the caption there, misaligning every later caption of ``pycocoevalcap``'s output."""
    tokens = (token.lower() for token in _lex(text.replace("\n", " ") + "\n"))
    return " ".join(token for token in tokens if token not in PUNCTUATION)


MAX_N = 4
CIDER_SIGMA = 6.0


def _check(references: Mapping[Hashable, Sequence[str]], candidates: Mapping[Hashable, str]) -> None:
    """A score over images with no reference is undefined, so it is refused, not guessed."""
    if not candidates:
        raise DataError("no candidate captions to score")
    for key in candidates:
        if key not in references:
            raise DataError(f"candidate caption for image {key!r} has no references: its key is not among "
                            "the references' keys")
    for key, captions in references.items():
        if not captions:
            raise DataError(f"image {key!r} has no reference captions")


def _ngrams(caption: str) -> Counter:
    """Counts of every n-gram, n = 1..4, of a tokenized caption (tokens split on whitespace)."""
    words = caption.split()
    return Counter(tuple(words[i:i + n]) for n in range(1, MAX_N + 1) for i in range(len(words) - n + 1))


def bleu(references: Mapping[Hashable, Sequence[str]], candidates: Mapping[Hashable, str]) -> list[float]:
    """Corpus BLEU-1..4 of tokenized captions, as ``pycocoevalcap``'s ``Bleu(4)`` scores them.

    Clipped n-gram matches and candidate n-grams are summed over the corpus before dividing (a
    corpus score, not a mean of sentence scores); the brevity penalty compares the candidates'
    total length with the sum, over images, of the reference length closest to each candidate
    (the shorter one on a tie). The 1e-15 and 1e-9 keep a corpus with no match at some n at ~0
    rather than dividing by zero."""
    _check(references, candidates)
    correct, guess = [0] * MAX_N, [0] * MAX_N
    test_len = ref_len = 0
    for key, candidate in candidates.items():
        counts, length = _ngrams(candidate), len(candidate.split())
        clip: Counter = Counter()
        for reference in references[key]:
            clip |= _ngrams(reference)
        lengths = [len(reference.split()) for reference in references[key]]
        ref_len += min(lengths, key=lambda r: (abs(r - length), r))
        test_len += length
        for gram, count in counts.items():
            correct[len(gram) - 1] += min(count, clip[gram])
        for n in range(MAX_N):
            guess[n] += max(0, length - n)
    scores, product = [], 1.0
    for n in range(MAX_N):
        product *= (correct[n] + 1e-15) / (guess[n] + 1e-9)
        scores.append(product ** (1.0 / (n + 1)))
    ratio = (test_len + 1e-15) / (ref_len + 1e-9)
    penalty = math.exp(1 - 1 / ratio) if ratio < 1 else 1.0
    return [score * penalty for score in scores]


class _Vector(NamedTuple):
    """A caption's tf-idf weights per n, their norms, and its length in words. (pycocoevalcap counts
    bigrams, words less one: the difference of two lengths is the same whenever both captions have
    words, and where one has none the similarity is 0 whatever the penalty.)"""

    weights: list[dict[tuple[str, ...], float]]
    norms: list[float]
    length: int


def _tfidf(counts: Counter, document_frequency: Counter, log_images: float) -> _Vector:
    """An n-gram in no reference weighs as one seen in a single image's."""
    weights: list[dict] = [{} for _ in range(MAX_N)]
    for gram, count in counts.items():
        weights[len(gram) - 1][gram] = count * (log_images - math.log(max(1.0, document_frequency[gram])))
    norms = [math.sqrt(sum(w * w for w in order.values())) for order in weights]
    return _Vector(weights, norms, sum(counts[g] for g in weights[0]))


def _similarity(candidate: _Vector, reference: _Vector) -> float:
    """Mean over n of the cosine of clipped weights, under the Gaussian length penalty."""
    penalty = math.exp(-((candidate.length - reference.length) ** 2) / (2 * CIDER_SIGMA ** 2))
    total = 0.0
    for n in range(MAX_N):
        ref = reference.weights[n]
        dot = sum(min(w, ref.get(gram, 0.0)) * ref.get(gram, 0.0) for gram, w in candidate.weights[n].items())
        if candidate.norms[n] != 0 and reference.norms[n] != 0:
            dot /= candidate.norms[n] * reference.norms[n]
        total += dot * penalty
    return total / MAX_N


def cider_d(references: Mapping[Hashable, Sequence[str]],
            candidates: Mapping[Hashable, str]) -> tuple[float, list[float]]:
    """CIDEr-D of tokenized captions: (the corpus mean, each image's score in the candidates' order),
    as ``pycocoevalcap``'s ``Cider`` scores them.

    Document frequencies count, for each n-gram, the evaluated images (the candidates' keys) whose
    references contain it, so a score depends on the set it is computed on, as the package's does."""
    _check(references, candidates)
    refs = {key: [_ngrams(reference) for reference in references[key]] for key in candidates}
    document_frequency = Counter(gram for counts in refs.values() for gram in set().union(*counts))
    log_images = math.log(len(candidates))
    scores = []
    for key, candidate in candidates.items():
        vector = _tfidf(_ngrams(candidate), document_frequency, log_images)
        similarities = [_similarity(vector, _tfidf(r, document_frequency, log_images)) for r in refs[key]]
        scores.append(10.0 * sum(similarities) / len(similarities))
    return sum(scores) / len(scores), scores


def caption_scores(references: Mapping[Hashable, Sequence[str]],
                   candidates: Mapping[Hashable, str]) -> dict[str, float]:
    """BLEU-1, BLEU-4 and CIDEr-D of raw captions, PTB-tokenized first as the COCO evaluation does.

    Only the candidates' images are scored; raises ``DataError`` naming an image whose key is not
    among the references' or which has no reference."""
    _check(references, candidates)
    refs = {key: [ptb_tokenize(r) for r in references[key]] for key in candidates}
    cands = {key: ptb_tokenize(caption) for key, caption in candidates.items()}
    bleus = bleu(refs, cands)
    return {"bleu1": bleus[0], "bleu4": bleus[3], "cider": cider_d(refs, cands)[0]}
