/* A stand-in libcuda.so.1 for tokenspeed-mooncake's engine.so on a host without an NVIDIA
 * driver: every driver call answers CUDA_ERROR_NO_DEVICE, so Mooncake takes host memory. */
#define NO_DEVICE 100

static const char *no_device = "no CUDA device (stand-in libcuda)";

int cuGetErrorString(int err, const char **out) { (void)err; if (out) *out = no_device; return 0; }
int cuGetErrorName(int err, const char **out) { (void)err; if (out) *out = "CUDA_ERROR_NO_DEVICE"; return 0; }

#define NONE(name) int name(void) { return NO_DEVICE; }
NONE(cuInit) NONE(cuCtxGetDevice) NONE(cuCtxSetCurrent) NONE(cuDeviceGet) NONE(cuDeviceGetAttribute)
NONE(cuDeviceGetCount) NONE(cuDriverGetVersion)
NONE(cuDevicePrimaryCtxRelease_v2) NONE(cuDevicePrimaryCtxRetain) NONE(cuMemAddressFree)
NONE(cuMemAddressReserve) NONE(cuMemCreate) NONE(cuMemExportToShareableHandle)
NONE(cuMemGetAddressRange_v2) NONE(cuMemGetAllocationGranularity) NONE(cuMemGetHandleForAddressRange)
NONE(cuMemImportFromShareableHandle) NONE(cuMemMap) NONE(cuMemRelease) NONE(cuMemRetainAllocationHandle)
NONE(cuMemSetAccess) NONE(cuMemUnmap) NONE(cuPointerGetAttribute) NONE(cuPointerSetAttribute)
NONE(cuGetProcAddress) NONE(cuGetProcAddress_v2)
