"""The bookkeeping of the tests/tools checks: every comparison is named, and any mismatch fails
the run."""


class Failures(list):
    """The mismatches found so far, one line each."""

    def check(self, name, got, want, tol=1e-6):
        """got within tol of want: relative to want, or absolute where |want| < 1."""
        if got is None or want is None or abs(got - want) > tol * max(1.0, abs(want)):
            self.append(f"{name}: {got} (expected {want})")

    def report(self, what):
        """Prints each mismatch and a last line for `what`; the exit status (1 on a mismatch)."""
        for line in self:
            print("FAILED", line)
        print(f"{'ok' if not self else 'failed'}: {what}, {len(self)} failure(s)")
        return 1 if self else 0
