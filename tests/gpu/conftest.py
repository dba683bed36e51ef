import pytest


@pytest.fixture(autouse=True, scope="session")
def kernel_options_of_the_environment():
    """The GPU suite runs its ops and engines under the kernel options a default ``EngineArgs`` resolves (its
    flags unset, so ``KIMIK3_FLASH_MLA`` / ``KIMIK3_FLASH_KDA`` / ``KIMIK3_PDL`` / ``KIMIK3_PREFETCH`` of the
    device call decide), as ``kimik3`` itself does."""
    from kimik3.engine.args import EngineArgs
    from kimik3.ops.options import KernelOptions, install_kernel_options
    install_kernel_options(EngineArgs().kernel_options())
    yield
    install_kernel_options(KernelOptions())
