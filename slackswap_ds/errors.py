"""Domain exceptions. Each message says what was expected, what was found, and what to do."""


class SlackSwapError(Exception):
    """Base class of every error slackswap_ds raises on purpose."""


class UnknownNameError(SlackSwapError, KeyError):
    """A preset name (workload, hardware, planner) that does not exist."""

    def __init__(self, kind: str, name: str, valid: list[str]):
        self.kind, self.name, self.valid = kind, name, sorted(valid)
        super().__init__(f"unknown {kind} {name!r}; valid choices: {', '.join(self.valid)}")

    def __str__(self) -> str:  # KeyError would otherwise quote the whole message
        return self.args[0]


class InvalidFileError(SlackSwapError, ValueError):
    """A hardware, profile or plan file that is malformed."""


class ProfileError(SlackSwapError, ValueError):
    """A StepProfile whose ops and activations do not fit together."""


class PlanError(SlackSwapError, ValueError):
    """A Plan that does not fit the profile it is applied to, or is malformed."""


class BudgetInfeasibleError(SlackSwapError):
    """A planner cannot meet the memory budget at all (e.g. the non-recomputable bytes alone exceed it)."""
