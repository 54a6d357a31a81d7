"""Incremental stop-string matching.

Stop strings are matched by one Knuth-Morris-Pratt automaton per string, fed only the characters each
token adds. Its state is the length of the longest suffix of the text so far that is a prefix of the
stop string, which is also the text to hold back from the client (it may yet become the stop string).
So a token costs O(number of stops x characters it added), amortized, whatever the length of the
output or of the stop strings: the text is never searched again, and no prefix of a stop is copied.
"""

from __future__ import annotations


def failure_table(stop: str) -> list[int]:
    """KMP's prefix function: table[i] = length of the longest proper prefix of stop[: i + 1] that is also
    its suffix."""
    table = [0] * len(stop)
    k = 0
    for i in range(1, len(stop)):
        while k and stop[i] != stop[k]:
            k = table[k - 1]
        if stop[i] == stop[k]:
            k += 1
        table[i] = k
    return table


class StopMatcher:
    """The matching state of one sequence against its request's stop strings.

    Invariant: states[j] = length of the longest suffix of the text fed so far that is a proper prefix of
    stops[j] (a full match ends the sequence, so no state ever equals len(stops[j])).
    """

    def __init__(self, stops: list[str], tables: list[list[int]]) -> None:
        self.stops = stops
        self.tables = tables
        self.states = [0] * len(stops)

    def feed(self, text: str, start: int) -> tuple[int, int] | None:
        """Advance over text[start:]; return (position, index) of the stop string whose match ends first
        (of those ending at the same character, the longest), or None."""
        best: tuple[int, int, int] | None = None  # (end, -length, index)
        for j, stop in enumerate(self.stops):
            end = self._advance(j, stop, text, start)
            if end is not None and (best is None or (end, -len(stop)) < best[:2]):
                best = (end, -len(stop), j)
        if best is None:
            return None
        end, minus_length, j = best
        return end + minus_length, j

    @property
    def held_back(self) -> int:
        return max(self.states, default=0)

    def _advance(self, j: int, stop: str, text: str, start: int) -> int | None:
        """Feed text[start:] to automaton j; the end (exclusive) of its first full match, or None."""
        table, k, i, n = self.tables[j], self.states[j], start, len(text)
        first = stop[0]
        while i < n:
            if k == 0:
                # Nothing pending: jump to the next occurrence of the first character (str.find, in C).
                i = text.find(first, i)
                if i < 0:
                    break
            c = text[i]
            while k and c != stop[k]:
                k = table[k - 1]
            if c == stop[k]:
                k += 1
                if k == len(stop):
                    self.states[j] = 0
                    return i + 1
            i += 1
        self.states[j] = k
        return None
