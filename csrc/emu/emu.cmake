# CMake support for the CUDA emulator (csrc/emu): an interface target for code compiled against it, and
# megakernels_emu_test() to register a C++ test of emulated kernels in three flavours.
#
#   include(<repo>/csrc/emu/emu.cmake)   # or add_subdirectory(csrc/emu), which includes it
#
#   megakernels_emu_test(<name> SOURCES <file.cpp|file.cu>... [ARGS <arg>...] [FLAVOURS plain asan tsan]
#                        [SLOW_FLAVOURS asan tsan])
#     Builds <name>_plain (-O1 -g1), <name>_asan (AddressSanitizer) and <name>_tsan (ThreadSanitizer) and adds
#     a ctest test of the same name for each. A .cu source is compiled as C++ through a generated one-line
#     wrapper that #includes it (g++ does not know the .cu extension), with MEGAKERNELS_CUDA_EMU defined and
#     csrc/ on the include path, so the file includes "common/cuda_compat.h". Flavours whose sanitizer the
#     compiler cannot build are skipped with a message. Flavours named in SLOW_FLAVOURS are built as the others
#     but labelled `slow`: `ctest -LE slow` (scripts/test.sh) leaves them out, `ctest` (test.sh --all) runs them.
#
# Cache variables: MEGAKERNELS_CUDA_INCLUDE_DIR (where cuda_bf16.h lives; found from CUDAToolkit, $CUDA_HOME,
# $CUDA_PATH or /usr/local/cuda), MEGAKERNELS_NVCC (for the nvcc compile check; optional).
include_guard(GLOBAL)

get_filename_component(_mk_csrc "${CMAKE_CURRENT_LIST_DIR}/.." ABSOLUTE)
set(MEGAKERNELS_EMU_CSRC_DIR "${_mk_csrc}" CACHE INTERNAL "megakernels csrc/ directory")

# The emulator needs only CUDA's host-compilable headers, never libcudart or a GPU.
find_package(CUDAToolkit QUIET)
find_path(MEGAKERNELS_CUDA_INCLUDE_DIR cuda_bf16.h
  HINTS ${CUDAToolkit_INCLUDE_DIRS} "$ENV{CUDA_HOME}/include" "$ENV{CUDA_PATH}/include" /usr/local/cuda/include
  DOC "Directory with CUDA's cuda_bf16.h / cuda_fp16.h / vector_types.h")
if(NOT MEGAKERNELS_CUDA_INCLUDE_DIR)
  message(FATAL_ERROR "megakernels emu: cuda_bf16.h not found; set CUDA_HOME or MEGAKERNELS_CUDA_INCLUDE_DIR")
endif()
find_program(MEGAKERNELS_NVCC nvcc HINTS "${CUDAToolkit_BIN_DIR}" "$ENV{CUDA_HOME}/bin" /usr/local/cuda/bin
  DOC "nvcc, used only to check that kernel sources still compile for the GPU")

find_package(Threads REQUIRED)

if(NOT TARGET megakernels_emu)
  add_library(megakernels_emu INTERFACE)
  target_include_directories(megakernels_emu INTERFACE "${MEGAKERNELS_EMU_CSRC_DIR}")
  target_include_directories(megakernels_emu SYSTEM INTERFACE "${MEGAKERNELS_CUDA_INCLUDE_DIR}")
  target_compile_definitions(megakernels_emu INTERFACE MEGAKERNELS_CUDA_EMU=1)
  target_compile_features(megakernels_emu INTERFACE cxx_std_17)
  # `#pragma unroll` is nvcc's; GCC 12 warns about it even under #pragma GCC diagnostic ignored.
  target_compile_options(megakernels_emu INTERFACE $<$<CXX_COMPILER_ID:GNU,Clang>:-Wno-unknown-pragmas>)
  target_link_libraries(megakernels_emu INTERFACE Threads::Threads)
endif()

include(CheckCXXSourceCompiles)
function(_megakernels_emu_check_sanitizer flag result)
  if(NOT DEFINED ${result})
    set(CMAKE_REQUIRED_FLAGS "-fsanitize=${flag}")
    set(CMAKE_REQUIRED_LINK_OPTIONS "-fsanitize=${flag}")
    set(CMAKE_REQUIRED_QUIET ON)
    check_cxx_source_compiles("int main() { return 0; }" ${result})
  endif()
endfunction()
_megakernels_emu_check_sanitizer(address MEGAKERNELS_EMU_HAVE_ASAN)
_megakernels_emu_check_sanitizer(thread MEGAKERNELS_EMU_HAVE_TSAN)

function(megakernels_emu_test name)
  cmake_parse_arguments(PARSE_ARGV 1 arg "" "" "SOURCES;ARGS;FLAVOURS;SLOW_FLAVOURS")
  if(NOT arg_SOURCES)
    message(FATAL_ERROR "megakernels_emu_test(${name}): SOURCES is required")
  endif()
  if(NOT arg_FLAVOURS)
    set(arg_FLAVOURS plain asan tsan)
  endif()

  set(sources "")
  foreach(src IN LISTS arg_SOURCES)
    get_filename_component(abs "${src}" ABSOLUTE BASE_DIR "${CMAKE_CURRENT_SOURCE_DIR}")
    if(abs MATCHES "\\.cu$")
      get_filename_component(stem "${abs}" NAME_WE)
      string(MD5 path_hash "${abs}")
      string(SUBSTRING "${path_hash}" 0 8 path_hash)  # two families may both have a kernels.cu
      set(wrapper "${CMAKE_CURRENT_BINARY_DIR}/${name}_emu_sources/${stem}_${path_hash}.cu.cpp")
      file(CONFIGURE OUTPUT "${wrapper}" CONTENT "#include \"${abs}\"\n" @ONLY)
      list(APPEND sources "${wrapper}")
    else()
      list(APPEND sources "${abs}")
    endif()
  endforeach()

  foreach(flavour IN LISTS arg_FLAVOURS)
    set(san "")
    if(flavour STREQUAL "asan")
      if(NOT MEGAKERNELS_EMU_HAVE_ASAN)
        message(STATUS "megakernels emu: no AddressSanitizer, skipping ${name}_asan")
        continue()
      endif()
      set(san -fsanitize=address -fno-omit-frame-pointer)
    elseif(flavour STREQUAL "tsan")
      if(NOT MEGAKERNELS_EMU_HAVE_TSAN)
        message(STATUS "megakernels emu: no ThreadSanitizer, skipping ${name}_tsan")
        continue()
      endif()
      set(san -fsanitize=thread)
    elseif(NOT flavour STREQUAL "plain")
      message(FATAL_ERROR "megakernels_emu_test(${name}): unknown flavour ${flavour}")
    endif()
    set(target "${name}_${flavour}")
    add_executable(${target} ${sources})
    target_link_libraries(${target} PRIVATE megakernels_emu)
    # -g1 (line tables): sanitizer reports still name file:line, and the heavily templated kernel sources compile
    # in half the time of full -g.
    target_compile_options(${target} PRIVATE -O1 -g1 ${san})
    target_link_options(${target} PRIVATE ${san})
    add_test(NAME ${target} COMMAND ${target} ${arg_ARGS})
    set(labels "emu;${flavour}")
    if(flavour IN_LIST arg_SLOW_FLAVOURS)
      list(APPEND labels slow)
    endif()
    set_tests_properties(${target} PROPERTIES TIMEOUT 300 LABELS "${labels}")
  endforeach()
endfunction()
