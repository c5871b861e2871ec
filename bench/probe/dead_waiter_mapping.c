// Probe: a legacy-IPC exporter is SIGKILLed while a stream of its own is blocked in
// cuStreamWaitValue64 on its own memory (as a renderer worker's stream waits on the
// compositor's release fence in its inbox). Do the importer's streams go on: a write into
// its mapping of the dead process's memory, a wait on the importer's own memory released
// by a write of its own, an unrelated copy? And with the importer's write queued before
// the death, behind a gate? Each poll is bounded (3 s): "STUCK" is the answer that matters.
// Build: nvcc -O2 -o /tmp/q dead_waiter_mapping.c -lcuda; run: /tmp/q; /tmp/q queued
#define _GNU_SOURCE
#include <cuda.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <signal.h>
#include <unistd.h>
#include <sys/wait.h>
#include <time.h>
#define CK(x) do { CUresult r_ = (x); if (r_ != CUDA_SUCCESS) { const char* s; cuGetErrorName(r_, &s); printf("%s -> %s\n", #x, s); } } while (0)
static double now(void){ struct timespec t; clock_gettime(CLOCK_MONOTONIC,&t); return t.tv_sec + t.tv_nsec*1e-9; }
static const char* poll_stream(CUstream s, double secs){ double t0=now(); for(;;){ CUresult r=cuStreamQuery(s); if(r==CUDA_SUCCESS) return "done"; if(r!=CUDA_ERROR_NOT_READY){static char b[64]; const char*n; cuGetErrorName(r,&n); snprintf(b,64,"error %s",n); return b;} if(now()-t0>secs) return "STUCK"; usleep(200);} }
int main(int argc, char** argv){
  int queued = argc > 1 && !strcmp(argv[1], "queued");
  int p[2]; pipe(p);
  pid_t c = fork();
  if (c == 0) {
    cuInit(0); CUdevice d; cuDeviceGet(&d,0); CUcontext x; cuDevicePrimaryCtxRetain(&x,d); cuCtxSetCurrent(x);
    CUdeviceptr m; cuMemAlloc(&m, 1<<20); cuMemsetD8(m, 0, 1<<20); CUipcMemHandle h; cuIpcGetMemHandle(&h, m);
    // Blocked on its own memory, for a value nobody writes (its peer's release fence).
    CUstream w; cuStreamCreate(&w, CU_STREAM_NON_BLOCKING);
    cuStreamWaitValue64(w, m + 64, 1000, CU_STREAM_WAIT_VALUE_GEQ);
    cuStreamWriteValue64(w, m + 128, 7, 0);
    write(p[1], &h, sizeof h); pause(); _exit(0);
  }
  CK(cuInit(0)); CUdevice d; CK(cuDeviceGet(&d,0)); CUcontext x; CK(cuDevicePrimaryCtxRetain(&x,d)); CK(cuCtxSetCurrent(x));
  CUipcMemHandle h; read(p[0], &h, sizeof h); usleep(200000);
  CUdeviceptr m; CK(cuIpcOpenMemHandle(&m, h, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS));
  CUdeviceptr own; CK(cuMemAlloc(&own, 4096)); CK(cuMemsetD8(own, 0, 4096));
  CUstream r, s, watch, other;
  CK(cuStreamCreate(&r, CU_STREAM_NON_BLOCKING)); CK(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
  CK(cuStreamCreate(&watch, CU_STREAM_NON_BLOCKING)); CK(cuStreamCreate(&other, CU_STREAM_NON_BLOCKING));
  CK(cuStreamWriteValue64(r, m, 1, 0)); printf("write into the live peer's memory: %s\n", poll_stream(r, 3));
  // Our stream waits on our own memory for the peer's acquire fence, which it never writes.
  CK(cuStreamWaitValue64(s, own, 5, CU_STREAM_WAIT_VALUE_GEQ));
  if (queued) { CK(cuStreamWaitValue64(r, own + 8, 1, CU_STREAM_WAIT_VALUE_GEQ)); CK(cuStreamWriteValue64(r, m, 2, 0)); }
  kill(c, SIGKILL); int st; waitpid(c, &st, 0); usleep(300000);
  printf("peer dead, its stream blocked on its own memory (%s)\n", queued ? "our write queued before, gated" : "our write after");
  if (queued) { CK(cuStreamWriteValue64(watch, own + 8, 1, 0)); printf("gate opened: %s\n", poll_stream(watch, 3)); }
  else CK(cuStreamWriteValue64(r, m, 3, 0));
  printf("write into the dead peer's memory: %s\n", poll_stream(r, 3));
  CK(cuStreamWriteValue64(watch, own, 1ull << 32, 0)); printf("release write on our watch stream: %s\n", poll_stream(watch, 3));
  printf("our stream's wait on our own memory: %s\n", poll_stream(s, 3));
  unsigned long long v = 0; CK(cuMemcpyDtoHAsync(&v, m, 8, other)); printf("read back the dead peer's memory: %s value %llu\n", poll_stream(other, 3), v);
  double t0 = now(); CK(cuIpcCloseMemHandle(m)); printf("close took %.1f ms\n", (now()-t0)*1e3);
  fflush(stdout); _exit(0);
}
