# Install rules for the Debian packages (packaging/build-deb) and for `cmake --install`.
# Two components, one per package:
#   assay         assayd, the assay client, assay-fingerprint, assay-compare, systemd units, sysusers/tmpfiles,
#                 the default config, schemas and docs
#   assay-oracle  assay-oracle (links LibTorch), so hosts without LibTorch can run the rest
# Workers live in libexec: users never call them directly, assayd finds them through
# /etc/assay/assayd.json. assayd-serve, the daemon that `assayd serve` execs, lives there too.
# Unit paths follow Debian 12 (units in /lib/systemd/system).
include(GNUInstallDirs)

set(ASSAY_SYSTEMD_UNITDIR /lib/systemd/system CACHE PATH "systemd system unit directory")
set(ASSAY_SYSUSERSDIR /usr/lib/sysusers.d CACHE PATH "sysusers.d directory")
set(ASSAY_TMPFILESDIR /usr/lib/tmpfiles.d CACHE PATH "tmpfiles.d directory")
set(ASSAY_CONFDIR /etc/assay CACHE PATH "directory of assayd.json")
set(ASSAY_WORKERDIR ${CMAKE_INSTALL_LIBEXECDIR}/assay)

foreach(spec "assayd;${CMAKE_INSTALL_SBINDIR};assay" "assayd-serve;${ASSAY_WORKERDIR};assay"
             "assay;${CMAKE_INSTALL_BINDIR};assay"
             "assay-fingerprint;${ASSAY_WORKERDIR};assay" "assay-compare;${ASSAY_WORKERDIR};assay"
             "assay-oracle;${ASSAY_WORKERDIR};assay-oracle")
  list(GET spec 0 target)
  list(GET spec 1 destination)
  list(GET spec 2 component)
  if(TARGET ${target})
    install(TARGETS ${target} RUNTIME DESTINATION ${destination} COMPONENT ${component})
  endif()
endforeach()

install(FILES ${PROJECT_SOURCE_DIR}/systemd/assayd.service ${PROJECT_SOURCE_DIR}/systemd/assayd.socket
        DESTINATION ${ASSAY_SYSTEMD_UNITDIR} COMPONENT assay)
install(FILES ${PROJECT_SOURCE_DIR}/systemd/assay.sysusers DESTINATION ${ASSAY_SYSUSERSDIR}
        RENAME assay.conf COMPONENT assay)
install(FILES ${PROJECT_SOURCE_DIR}/systemd/assay.tmpfiles DESTINATION ${ASSAY_TMPFILESDIR}
        RENAME assay.conf COMPONENT assay)
install(FILES ${PROJECT_SOURCE_DIR}/systemd/assayd.json DESTINATION ${ASSAY_CONFDIR} COMPONENT assay)
install(DIRECTORY ${PROJECT_SOURCE_DIR}/schemas/ DESTINATION ${CMAKE_INSTALL_DATADIR}/assay/schemas
        COMPONENT assay FILES_MATCHING PATTERN "*.json")
# The OpenAPI document with every schema it names inside it (scripts/bundle-openapi): refs
# resolve without network or other files. Built where the Python has PyYAML (the pinned venv).
if(ASSAY_PYTHON3)
  file(GLOB _assay_schema_files ${PROJECT_SOURCE_DIR}/schemas/*.json)
  add_custom_command(
    OUTPUT ${CMAKE_BINARY_DIR}/openapi.json
    COMMAND ${ASSAY_PYTHON3} ${PROJECT_SOURCE_DIR}/scripts/bundle-openapi ${CMAKE_BINARY_DIR}/openapi.json
    DEPENDS ${PROJECT_SOURCE_DIR}/scripts/bundle-openapi ${PROJECT_SOURCE_DIR}/schemas/openapi.yaml
            ${_assay_schema_files}
    COMMENT "Bundling schemas/openapi.yaml with its schemas"
    VERBATIM)
  add_custom_target(assay_openapi ALL DEPENDS ${CMAKE_BINARY_DIR}/openapi.json)
  install(FILES ${CMAKE_BINARY_DIR}/openapi.json DESTINATION ${CMAKE_INSTALL_DATADIR}/assay
          COMPONENT assay)
endif()
# The transformers worker: its script and the lock of its Python environment, which
# assay-hf-setup makes on the host (one command; the launcher lands at config hf_worker).
install(FILES ${PROJECT_SOURCE_DIR}/worker/hf/assay_hf_worker.py ${PROJECT_SOURCE_DIR}/requirements.lock
        DESTINATION ${CMAKE_INSTALL_DATADIR}/assay/hf COMPONENT assay)
install(PROGRAMS ${PROJECT_SOURCE_DIR}/packaging/assay-hf-setup DESTINATION ${CMAKE_INSTALL_SBINDIR}
        COMPONENT assay)

# Man pages written from the programs' own --help (scripts/make-man), compressed reproducibly.
if(ASSAY_PYTHON3 AND TARGET assay AND TARGET assayd)
  string(TIMESTAMP _assay_man_date "%Y-%m-%d" UTC)  # honours SOURCE_DATE_EPOCH
  set(_assay_man_dir ${CMAKE_BINARY_DIR}/man)
  add_custom_command(
    OUTPUT ${_assay_man_dir}/assay.1.gz ${_assay_man_dir}/assayd.8.gz
           ${_assay_man_dir}/assay-hf-setup.8.gz
    COMMAND ${CMAKE_COMMAND} -E make_directory ${_assay_man_dir}
    COMMAND ${ASSAY_PYTHON3} ${PROJECT_SOURCE_DIR}/scripts/make-man $<TARGET_FILE:assay> 1
            ${PROJECT_VERSION} ${_assay_man_dir}/assay.1.gz --date ${_assay_man_date}
            --summary "submit disputes between LLM inference engines to assayd and verify its signed results"
    COMMAND ${ASSAY_PYTHON3} ${PROJECT_SOURCE_DIR}/scripts/make-man $<TARGET_FILE:assayd> 8
            ${PROJECT_VERSION} ${_assay_man_dir}/assayd.8.gz --date ${_assay_man_date}
            --summary "settle disputes between LLM inference engines: the contained, signing daemon"
    COMMAND ${ASSAY_PYTHON3} ${PROJECT_SOURCE_DIR}/scripts/make-man
            ${PROJECT_SOURCE_DIR}/packaging/assay-hf-setup 8 ${PROJECT_VERSION}
            ${_assay_man_dir}/assay-hf-setup.8.gz --date ${_assay_man_date}
            --summary "make assay's transformers worker usable on this host (its pinned Python environment and launcher)"
    DEPENDS assay assayd ${PROJECT_SOURCE_DIR}/scripts/make-man
            ${PROJECT_SOURCE_DIR}/packaging/assay-hf-setup
    COMMENT "Writing the man pages from --help"
    VERBATIM)
  add_custom_target(assay_man ALL DEPENDS ${_assay_man_dir}/assay.1.gz ${_assay_man_dir}/assayd.8.gz
                                          ${_assay_man_dir}/assay-hf-setup.8.gz)
  install(FILES ${_assay_man_dir}/assay.1.gz DESTINATION ${CMAKE_INSTALL_MANDIR}/man1 COMPONENT assay)
  install(FILES ${_assay_man_dir}/assayd.8.gz ${_assay_man_dir}/assay-hf-setup.8.gz
          DESTINATION ${CMAKE_INSTALL_MANDIR}/man8 COMPONENT assay)
endif()
install(FILES ${PROJECT_SOURCE_DIR}/README.md ${PROJECT_SOURCE_DIR}/docs/architecture.md
        DESTINATION ${CMAKE_INSTALL_DOCDIR} COMPONENT assay)
foreach(doc client/README.md supervisor/README.md fingerprint/README.md)
  if(EXISTS ${PROJECT_SOURCE_DIR}/${doc})
    get_filename_component(dir ${doc} DIRECTORY)
    install(FILES ${PROJECT_SOURCE_DIR}/${doc} DESTINATION ${CMAKE_INSTALL_DOCDIR} RENAME README.${dir}.md
            COMPONENT assay)
  endif()
endforeach()

# Where the installed assay-oracle finds LibTorch (its RUNPATH). Empty: the lib folder of the
# LibTorch it was built against (a GPU host's own PyTorch: `packaging/build-deb --torch-from-host`,
# so libtorch_cuda.so beside it serves --device cuda). packaging/build-deb's default bundles
# that LibTorch's CPU libraries in ${CMAKE_INSTALL_LIBDIR}/assay-oracle and points here.
set(ASSAY_ORACLE_TORCH_RPATH "" CACHE STRING "RUNPATH of the installed assay-oracle")
if(TARGET assay-oracle)
  if(ASSAY_ORACLE_TORCH_RPATH)
    set_target_properties(assay-oracle PROPERTIES INSTALL_RPATH "${ASSAY_ORACLE_TORCH_RPATH}")
  else()
    set_target_properties(assay-oracle PROPERTIES INSTALL_RPATH "${ASSAY_TORCH_ROOT}/lib")
  endif()
endif()
