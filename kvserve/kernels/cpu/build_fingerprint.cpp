// The install build's fingerprint (build_config.py), kept in the module's binary where the loader reads it
// before importing the module. The run-time build leaves it undefined: its cache is keyed by torch instead.
#define KVSERVE_STRINGIFY_(x) #x
#define KVSERVE_STRINGIFY(x) KVSERVE_STRINGIFY_(x)
#ifdef KVSERVE_FINGERPRINT
extern "C" __attribute__((used, visibility("default"))) const char kvserve_build_fingerprint[] =
    "kvserve-build-fingerprint:" KVSERVE_STRINGIFY(KVSERVE_FINGERPRINT);
#endif
