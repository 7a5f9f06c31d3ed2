"""The platform week: every gpuplane capability on one fleet and one world (`gpuplane scenario platform-week`)."""

from gpuplane.sim.platform.fleet import CAPABILITIES, PlatformSettings, build_fleet
from gpuplane.sim.platform.scenario import ARMS, PLATFORM, SCENARIO, VANILLA, PlatformFigures, run_week
from gpuplane.sim.platform.week import ArmRun, run_arm

__all__ = ["ARMS", "CAPABILITIES", "PLATFORM", "SCENARIO", "VANILLA", "ArmRun", "PlatformFigures",
           "PlatformSettings", "build_fleet", "run_arm", "run_week"]
